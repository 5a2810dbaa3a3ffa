"""kungfu-run, one concern per module; each imports only those above it in this list:

- output: the workers' lines with their rank in front, and kungfu-run's own log lines;
- flags: the command line (Options, parse_args, -help) and what it promises (exit codes);
- plan: the hosts, this host, the ports, the job's secret, the GPU of each worker;
- processes: spawning, reaping and signalling this host's workers, and blaming a failure;
- launcher: the event loop (Launcher) that supervises a job;
- resize_progress, elastic: the loop of -w (ElasticLauncher), which extends the launcher's;
- ssh: the ssh start (SshLauncher), one command for a static job on several hosts, which
  extends the launcher's loop with the other hosts' launchers.

kungfu/cmd/ parses the command line and picks the launcher. The workers never import this
package: what both sides need (placing workers on hosts) is kungfu/_hosts.py.
"""
