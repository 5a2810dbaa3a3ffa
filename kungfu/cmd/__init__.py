"""The `kungfu-run` command: see `kungfu-run -help` and docs/kungfu-run.md."""
from __future__ import annotations

import sys
from typing import Optional, Sequence

from kungfu._version import __version__
from kungfu._hosts import UsageError
from kungfu._launch import flags, output, plan, ssh
from kungfu._launch.elastic import ElasticLauncher
from kungfu._launch.launcher import Launcher


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of kungfu-run; returns (and, as a script, exits with) the job's exit code."""
    try:
        return run(sys.argv[1:] if argv is None else argv)
    except KeyboardInterrupt:
        # Interrupted before the workers' signal handling was in place.
        sys.stderr.write("kungfu-run: interrupted\n")
        return 130


def run(argv: Sequence[str]) -> int:
    """Checks the command line and plans the job, then runs this host's part of it: with -w
    the elastic launcher, else the static one; the ssh start (kungfu/_launch/ssh.py) runs
    either here and starts the other hosts' launchers."""
    try:
        opts = flags.parse_args(argv)
        if opts.help:
            sys.stdout.write(flags.help_text())
            sys.stdout.flush()
            return 0
        if opts.version:
            sys.stdout.write(f"{flags.PROG} (kungfu) {__version__}\n")
            sys.stdout.flush()
            return 0
        output.configure_logging(output._Output(output._binary(sys.stderr)), opts.quiet,
                                 opts.verbose)
        if opts.manager:
            output.logger.info(opts.manager)
        if opts.stdin_control:
            ssh.read_secret(ssh.settings()[1])
        job = plan.listen(opts, plan.prepare(opts))
    except UsageError as e:
        sys.stderr.write(f"{flags.PROG}: {e}\n")
        sys.stderr.flush()
        return flags.EXIT_USAGE
    if opts.stdin_control:
        return ssh.run_remote(opts, job)
    if job.remote and opts.elastic:
        return ssh.ElasticSshLauncher(opts, job.peers, job.mine, job.hosts, job.here,
                                      job.remote, job.listeners).run()
    if job.remote:
        return ssh.SshLauncher(opts, job.peers, job.mine, job.remote, job.listeners).run()
    if opts.elastic:
        return ElasticLauncher(opts, job.peers, job.mine, job.hosts, job.here,
                               job.listeners).run()
    if not job.mine:
        output.logger.info(f"none of the {opts.np} workers is placed on "
                           f"{', '.join(sorted(job.here))} (the hosts before it in -H take them "
                           f"all); nothing to run here")
        return 0
    return Launcher(opts, job.peers, job.mine, job.listeners).run()


__all__ = ["main"]
