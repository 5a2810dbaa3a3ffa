"""Worker bodies for test_monitor.py: gradient monitoring in real processes.

The bodies return raw data (every worker's gradients, batch sizes and estimates); the tests
compute the numpy reference and judge.
"""
from __future__ import annotations

import math

import numpy as np

from _w_tf_optim import _setup


def _flat64(tensors):
    return np.concatenate([np.asarray(t, dtype=np.float64).ravel() for t in tensors])


def stats_steps(steps: int, decay: float, interval: int, monitors=("gns", "variance"),
                scales=None):
    """Runs a GradientMonitor of `monitors` over `steps` steps of random gradients (three
    tensors of three float dtypes, batch size 4 + 3 * rank) inside a tf.function, as
    kf.Optimizer does: start() before the gradients' allreduce, update() after. With `scales`
    (one per rank) this worker's local gradient is its own mean gradient divided by its scale
    (0 for a scale of 0: no samples of its own), as kf.ElasticData's weighted parts give it.
    Returns per step: this worker's local and averaged gradients (float64, flattened), its
    batch size, the estimates (NaN where not monitored) and whether the statistics were
    started early."""
    kf, tf, _ = _setup()
    from kungfu.tensorflow import _monitor, ops

    rank, size = kf.rank(), kf.size()
    batch = 4 + 3 * rank
    monitor = _monitor.GradientMonitor(list(monitors), interval=interval, decay=decay,
                                       batch_size=batch)
    scale = 1.0 if scales is None else float(scales[rank])
    monitor.local_scale.assign(scale)
    shapes = [((5, 3), tf.float32), ((7,), tf.float64), ((4, 2), tf.float16)]
    early = []

    @tf.function
    def step(local, i):
        started = monitor.start(local, i, "test/monitor")
        early.append(started is not None)
        averaged = [ops.all_reduce(g, name=f"test/avg/{k}") / tf.cast(size, g.dtype)
                    for k, g in enumerate(local)]
        ran = monitor.update(local, averaged, i, "test/monitor", started)
        return averaged, ran

    out = []
    rng = np.random.default_rng(1000 + rank)
    for i in range(steps):
        # A shared direction plus per-worker noise, so |G|^2 > 0 and the variance is not 0.
        local = []
        for k, (shape, dt) in enumerate(shapes):
            common = np.random.default_rng(k).standard_normal(shape)
            noise = rng.standard_normal(shape) / math.sqrt(batch)
            own = common + noise
            local.append(tf.constant(own / scale if scale > 0 else 0 * own, dtype=dt))
        averaged, ran = step(local, tf.constant(i, tf.int64))
        out.append({
            "local": _flat64([t.numpy() for t in local]),
            "averaged": _flat64([t.numpy() for t in averaged]),
            "batch": batch,
            "ran": bool(ran.numpy()),
            "gns": monitor.value("gns"),
            "variance": monitor.value("variance") if "variance" in monitors else math.nan,
            "api": (kf.grad_noise_scale(),
                    kf.grad_variance() if "variance" in monitors else math.nan),
            "early": early[-1],
        })
    return out


def linear_regression(d: int, sigma: float, batch: int, steps: int, decay: float,
                      passes: int = 1):
    """model.fit of y = x.w* + sigma * noise at a fixed point w = w* + delta (|delta| = 1,
    learning rate 0, so the noise scale does not drift), with gns monitored every step and
    `passes` backward passes of `batch` samples averaged into each.

    The true simple noise scale of the MSE gradient (x ~ N(0, I_d)) is
    ((d + 1) |delta|^2 + d sigma^2) / |delta|^2. Returns the estimate, History's gns values and
    the value of kf.grad_noise_scale()."""
    kf, tf, keras = _setup()
    rank = kf.rank()
    rng = np.random.default_rng(7 + rank)
    w_star = np.linspace(-1, 1, d)
    delta = np.ones(d) / math.sqrt(d)
    x = rng.standard_normal((steps * batch, d)).astype(np.float32)
    y = (x @ w_star + sigma * rng.standard_normal(steps * batch)).astype(np.float32)[:, None]
    model = keras.Sequential([keras.Input((d,)), keras.layers.Dense(1, use_bias=False)])
    model.layers[0].kernel.assign((w_star + delta)[:, None].astype(np.float32))
    opt = kf.Optimizer(keras.optimizers.SGD(0.0), monitor="gns", batch_size=batch,
                       monitor_decay=decay, backward_passes_per_step=passes)
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    history = model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0,
                        callbacks=[kf.Hook()])
    return {
        "estimate": opt.kungfu_monitor.value("gns"),
        "api": kf.grad_noise_scale(),
        "history": history.history.get("gns"),
        "loss": history.history["loss"],
    }


def fit_logs(interval: int, batch: int):
    """model.fit with both monitors and kf.Hook: the per-batch logs (as a later callback sees
    them) and History; the number of monitored steps."""
    kf, tf, keras = _setup()
    rank = kf.rank()
    rng = np.random.default_rng(rank)
    x = rng.standard_normal((batch * 6, 5)).astype(np.float32)
    y = rng.standard_normal((batch * 6, 2)).astype(np.float32)
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"),
                              keras.layers.Dense(2)])
    opt = kf.Optimizer(keras.optimizers.SGD(0.1), monitor=["gns", "variance"],
                       batch_size=batch, monitor_interval=interval)
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, b, logs=None):
            seen.append({k: logs.get(k) for k in ("gns", "grad_variance")})

    history = model.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0,
                        callbacks=[kf.Hook(), Record()])
    monitor = opt.kungfu_monitor
    return {
        "batches": seen,
        "history": {k: history.history.get(k) for k in ("gns", "grad_variance")},
        "samples": (float(monitor.gns_state.numpy()[2]), float(monitor.variance_state.numpy()[1])),
        "iterations": int(opt.iterations.numpy()),
    }


def compat_names():
    """KungFu's names: the monitoring optimizers and global_noise_scale (checked against the
    estimator run on the same statistics)."""
    kf, tf, keras = _setup()
    from kungfu.tensorflow import ops, optimizers

    rank, size = kf.rank(), kf.size()
    gns_opt = optimizers.MonitorGradientNoiseScaleOptimizer(keras.optimizers.SGD(0.1), 16,
                                                            monitor_interval=2, alpha=0.8)
    var_opt = optimizers.MonitorGradientVarianceOptimizer(keras.optimizers.SGD(0.1))
    g = tf.constant(np.random.default_rng(rank).standard_normal(10) + 1.0, tf.float32)
    avg = ops.all_reduce(g, name="compat/avg") / size
    values = [float(ops.global_noise_scale(16, 16 * size, g, avg, alpha=0.5, name="compat/gns"))
              for _ in range(3)]
    return {
        "gns_opt": (gns_opt.kungfu_algorithm, gns_opt.kungfu_monitor.monitors,
                    gns_opt.kungfu_monitor.interval, gns_opt.kungfu_monitor.decay,
                    float(gns_opt.kungfu_monitor.batch_size.numpy())),
        "var_opt": (var_opt.kungfu_algorithm, var_opt.kungfu_monitor.monitors),
        "local": g.numpy().astype(np.float64),
        "averaged": avg.numpy().astype(np.float64),
        "values": values,
    }


def bad_input():
    """Error texts for bad monitoring options and inputs (one process)."""
    kf, tf, keras = _setup()
    from kungfu.tensorflow import _monitor

    def error(fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the test reads type and text
            return f"{type(e).__name__}: {e}"
        return None

    sgd = keras.optimizers.SGD
    stats = _monitor.gradient_stats
    return {
        "none": error(kf.grad_noise_scale),
        "unknown": error(lambda: kf.Optimizer(sgd(0.1), monitor=["gns", "noise"])),
        "not_a_list": error(lambda: kf.Optimizer(sgd(0.1), monitor=3)),
        "no_batch": error(lambda: kf.Optimizer(sgd(0.1), monitor="gns")),
        "bad_batch": error(lambda: kf.Optimizer(sgd(0.1), monitor="gns", batch_size=-2)),
        "bad_interval": error(lambda: kf.Optimizer(sgd(0.1), monitor="variance",
                                                   monitor_interval=0)),
        "bad_decay": error(lambda: kf.Optimizer(sgd(0.1), monitor="variance", monitor_decay=1.0)),
        "sma": error(lambda: kf.Optimizer(sgd(0.1), algorithm="sma", monitor="variance")),
        "lengths": error(lambda: stats([tf.ones([3])], [tf.ones([3]), tf.ones([2])], 4, "x")),
        "sizes": error(lambda: stats([tf.ones([3])], [tf.ones([4])], 4, "x/sizes")),
        "zero_batch": error(lambda: stats([tf.ones([3])], [tf.ones([3])], 0, "x/zero")),
        "int_grads": error(lambda: stats([tf.ones([3], tf.int32)], [tf.ones([3], tf.int32)], 4,
                                         "x/int")),
        "variance_only_ok": error(lambda: kf.Optimizer(sgd(0.1), monitor="variance")),
    }


def mixed_precision_estimates():
    """The same fixed point (learning rate 0) and data, monitored with both estimates: in
    float32, then under mixed_float16 with compile wrapping kf.Optimizer in LossScaleOptimizer,
    then with kf.Optimizer(LossScaleOptimizer(SGD)). Returns each one's (gradient variance,
    tr(S), |G|^2) and loss scale: the loss scale (2^15 at the start) must not show in them."""
    kf, tf, keras = _setup()
    rng = np.random.default_rng(kf.rank())
    x = rng.normal(size=(8 * 16, 6)).astype(np.float32)
    y = (x.sum(axis=1, keepdims=True) + rng.normal(size=(8 * 16, 1))).astype(np.float32)
    out = {}
    for order in ("float32", "compile", "inner"):
        keras.mixed_precision.set_global_policy("float32" if order == "float32"
                                                else "mixed_float16")
        keras.utils.set_random_seed(5)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4, activation="tanh"),
                                  keras.layers.Dense(1, dtype="float32")])
        sgd = keras.optimizers.SGD(0.0)
        opt = kf.Optimizer(keras.optimizers.LossScaleOptimizer(sgd) if order == "inner" else sgd,
                           monitor=["gns", "variance"], batch_size=16,
                           op_prefix=f"mixed/{order}")
        model.compile(optimizer=opt, loss="mse", jit_compile=False)
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        monitor = opt.kungfu_monitor
        state = monitor.gns_state.numpy()
        scale = getattr(model.optimizer, "dynamic_scale", None)
        out[order] = {"variance": monitor.value("variance"), "trace": float(state[0]),
                      "g2": float(state[1]), "wrapper": type(model.optimizer).__name__,
                      "scale": None if scale is None else float(np.asarray(scale))}
    keras.mixed_precision.set_global_policy("float32")
    return out


def monitors_that_differ(settings, steps: int = 3):
    """kf.Optimizer(SGD, monitor=settings[rank]) steps in a tf.function; returns the error
    this worker raised (None if every step ran) and the variance it read."""
    kf, tf, keras = _setup()
    rank = kf.rank()
    opt = kf.Optimizer(keras.optimizers.SGD(0.1), monitor=settings[rank], batch_size=4)
    v = tf.Variable(tf.ones([8]))

    @tf.function
    def step(g):
        opt.apply([g], [v])

    rng = np.random.default_rng(rank)
    try:
        for _ in range(steps):
            step(tf.constant(rng.standard_normal(8), tf.float32))
    except Exception as e:  # noqa: BLE001 - the test judges it
        return {"error": f"{type(e).__name__}: {e}"}
    return {"error": None}
