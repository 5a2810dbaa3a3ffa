"""Worker bodies for test_adaptation.py: per-worker batch sizes and timing, real processes."""
from __future__ import annotations

import numpy as np

from _w_tf_optim import _setup


def uneven_split(sizes, monitors):
    """One step of model.fit over a global batch split as `sizes` by kf.set_batch_sizes (from a
    policy's before_train, after bad splits it must refuse), with kf.Optimizer(monitor=
    monitors). Returns the weights before and after, the same step computed here without kungfu
    on the union batch (SGD, lr 1), this worker's own mean gradient (flattened), the monitor's
    statistics and what the Hook saw."""
    kf, tf, keras = _setup()
    n = kf.size()
    total = sum(sizes)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((total, 5)).astype(np.float32)
    y = rng.standard_normal((total, 1)).astype(np.float32)

    def build():
        keras.utils.set_random_seed(3)
        m = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3, activation="tanh"),
                              keras.layers.Dense(1)])
        return m

    model = build()
    opt = kf.Optimizer(keras.optimizers.SGD(1.0), monitor=list(monitors))
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    w0 = [w.copy() for w in model.get_weights()]
    data = kf.ElasticData(x, y, batch_size=total // n, seed=1, record=True)
    errors = []

    class Split(kf.BasePolicy):
        def before_train(self, state):
            bad = [sizes + [1], sizes[:-1], [0] + sizes[1:], [-1] + sizes[1:],
                   [sizes[0] + 1] + sizes[1:], "4,4"]
            for b in bad:
                try:
                    kf.set_batch_sizes(b)
                except ValueError as e:
                    errors.append(str(e))
            self.before = list(state.batch_sizes)
            kf.set_batch_sizes(sizes)

    policy = Split()
    hook = kf.Hook(policy, data=data)
    model.fit(data.dataset(), epochs=1, callbacks=[hook], verbose=0)

    def grads(m, idx):
        with tf.GradientTape() as tape:
            loss = keras.losses.MeanSquaredError()(y[idx], m(x[idx]))
        g = tape.gradient(loss, m.trainable_variables)
        return np.concatenate([t.numpy().ravel() for t in g]).astype(np.float64), g

    ref = build()
    ref.set_weights(w0)
    _, union = grads(ref, np.arange(total))
    expected = [v.numpy() - g.numpy() for v, g in zip(ref.trainable_variables, union)]
    mine = data.served[-1]
    own, _ = grads(ref, mine)
    return {"before": policy.before, "errors": errors, "served": mine.tolist(),
            "after": [w.tolist() for w in model.get_weights()],
            "expected": [w.tolist() for w in expected],
            "own_grad": own.tolist(), "union_grad": grads(ref, np.arange(total))[0].tolist(),
            "stats": opt.kungfu_monitor.stats.numpy().tolist(),
            "gns": opt.kungfu_monitor.value("gns"),
            "batch_sizes": hook.state.batch_sizes,
            "local": hook.state.local_batch_size, "global": hook.state.global_batch_size,
            "compute_times": hook.state.metrics.get("compute_times"),
            "part_sizes": hook.state.metrics.get("part_sizes")}


def composed(double_at: int, steps: int):
    """Three policies in one Hook under emulated compute (KUNGFU_SAMPLE_TIME, KUNGFU_SLOWDOWN):
    LB-BSP, momentum compensation, and one that doubles the batch size at step `double_at`.
    Returns every step's (batch sizes, learning rate) after its decisions, and the compute
    times the Hook measured."""
    kf, tf, keras = _setup()
    from kungfu.policy import LoadBalancing, MomentumCompensation

    rng = np.random.default_rng(0)
    x = rng.standard_normal((4096, 4)).astype(np.float32)
    y = (x @ np.array([[1.0], [-1.0], [0.5], [2.0]], np.float32))
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=kf.Optimizer(keras.optimizers.SGD(0.01, momentum=0.9)),
                  loss="mse", jit_compile=False)
    data = kf.ElasticData(x, y, batch_size=16, seed=2)

    class Double(kf.BasePolicy):
        def after_step(self, state):
            if state.step == double_at:
                kf.set_batch_size(2 * state.global_batch_size // state.cluster_size)

    trace = []

    class Trace(kf.BasePolicy):  # last: sees what the others decided at the next step
        def after_step(self, state):
            trace.append({"step": state.step, "sizes": list(state.batch_sizes),
                          "lr": state.learning_rate,
                          "times": state.metrics.get("compute_times")})

    lb = LoadBalancing(every=2, warmup=2)
    hook = kf.Hook(Double(), lb, MomentumCompensation(steps=4), Trace(), data=data)
    model.fit(data.dataset(), epochs=1, steps_per_epoch=steps, callbacks=[hook], verbose=0)
    return {"trace": trace, "decisions": lb.decisions}
