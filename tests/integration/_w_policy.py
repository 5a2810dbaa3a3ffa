"""Worker bodies for test_policy.py: policies driven by kf.Hook in model.fit, real processes."""
from __future__ import annotations

import numpy as np

from _w_tf_optim import _digest, _setup


def adaptive_fit(samples: int, epochs: int):
    """One model.fit with a policy that, at fixed steps: installs a tree (decided on rank 0
    only), tries a malformed tree (every worker, expects ValueError), grows the batch size
    (rank 1 only) and sets the learning rate to 0 (rank 0 only). Returns what every step saw."""
    kf, tf, keras = _setup()
    from kungfu.policy import current_strategy

    rank, size = kf.rank(), kf.size()
    tree = [size - 1] * size  # rooted at the last rank
    log = []

    class Policy(kf.BasePolicy):
        def __init__(self):
            self.errors = []

        def before_step(self, s):
            log.append({"step": s.step, "epoch": s.epoch, "strategy": current_strategy(),
                        "batch": s.local_batch_size, "lr": s.learning_rate,
                        "weights": _digest(model.get_weights())})

        def after_step(self, s):
            if s.step == 2 and rank == 0:
                kf.set_tree(tree)
            if s.step == 4:
                try:
                    kf.set_tree([0] * (size + 1))
                except ValueError as e:
                    self.errors.append(str(e))
            if s.step == 5 and rank == min(1, size - 1):
                kf.set_batch_size(7)
            if s.step == 9 and rank == 0:
                kf.set_learning_rate(0.0)

    rng = np.random.default_rng(0)
    x = rng.standard_normal((samples, 6)).astype(np.float32)
    y = (x @ np.arange(6, dtype=np.float32))[:, None]
    data = kf.ElasticData(x, y, batch_size=4, seed=3, record=True)
    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
    model.compile(optimizer=kf.Optimizer(keras.optimizers.SGD(0.01)), loss="mse",
                  jit_compile=False)
    policy = Policy()
    history = model.fit(data.dataset(), epochs=epochs, verbose=0,
                        callbacks=[kf.Hook(policy, data=data)])
    return {
        "log": log,
        "errors": policy.errors,
        "served": [i.tolist() for i in data.served],
        "loss": history.history["loss"],
        "final": _digest(model.get_weights()),
        "strategy": current_strategy(),
    }


def outside_hook():
    """set_tree / set_strategy as plain collectives, and the actions that need a Hook."""
    kf, tf, keras = _setup()
    from kungfu.policy import current_strategy

    size = kf.size()
    out = {}
    kf.set_tree(list(range(size))[:1] * size)
    out["tree"] = current_strategy()
    kf.set_strategy("ring")
    out["ring"] = current_strategy()
    try:
        kf.set_tree([0] if kf.rank() == 0 else [0] * size)  # malformed on rank 0 only
    except Exception as e:  # noqa: BLE001
        out["one_bad"] = f"{type(e).__name__}: {e}"
    try:
        kf.set_tree([kf.rank()] * size if kf.rank() < 2 else [0] * size)  # valid, different
    except Exception as e:  # noqa: BLE001
        out["differ"] = f"{type(e).__name__}: {e}"
    out["after"] = current_strategy()
    x = kf.allreduce(np.arange(5, dtype=np.float32))
    out["sum"] = x.tolist()
    for name, fn in (("batch", lambda: kf.set_batch_size(3)),
                     ("lr", lambda: kf.set_learning_rate(0.1)),
                     ("bad_batch", lambda: kf.set_batch_size(0)),
                     ("bad_strategy", lambda: kf.set_strategy("NOPE"))):
        try:
            fn()
            out[name] = None
        except Exception as e:  # noqa: BLE001
            out[name] = f"{type(e).__name__}: {e}"
    return out


def adaptive_strategy(slow_ms: float):
    """AdaptiveStrategyPolicy driven by a plain numpy loop (its actions are then collectives):
    explore, exploit; then the chosen strategy is slowed down (rank 0 enters its allreduces
    `slow_ms` late, which the others wait for inside the operation when fusion is off) and the
    policy must move."""
    import time

    import kungfu as kf
    from kungfu.policy import AdaptiveStrategyPolicy, TrainingState, current_strategy

    cands = ["BINARY_TREE_STAR", "RING", "STAR"]
    policy = AdaptiveStrategyPolicy(cands, trial_steps=6, warmup_steps=1, check_steps=8,
                                    drop_ratio=0.3)
    state = TrainingState(rank=kf.rank(), cluster_size=kf.size())
    x = np.ones(1 << 18, dtype=np.float32)  # 1 MiB
    policy.before_train(state)
    slowed = None
    seen = []
    for step in range(100):
        name = current_strategy()["name"]
        seen.append(name)
        if step == 40:
            slowed = policy.best
        if name == slowed and kf.rank() == 0:
            time.sleep(slow_ms / 1000)
        y = kf.allreduce(x, name="grads")
        assert y[0] == kf.size()
        state.step = step + 1
        policy.after_step(state)
    return {"seen": seen, "trials": policy.trials, "history": policy.history,
            "decisions": policy.decisions, "slowed": slowed, "best": policy.best}


def custom_loop(samples: int):
    """kf.Hook without Keras: a GradientTape loop over ElasticData.epoch_batches(), a policy
    doubling the batch (rank 0 only) after step 3. Returns the batch shapes and samples served."""
    kf, tf, keras = _setup()

    class Double(kf.BasePolicy):
        def after_step(self, s):
            if s.step == 3 and kf.rank() == 0:
                kf.set_batch_size(2 * s.local_batch_size)

    x = np.arange(samples * 2, dtype=np.float32).reshape(samples, 2)
    data = kf.ElasticData(x, x[:, :1], batch_size=3, record=True)
    w = tf.Variable([[0.0], [0.0]])
    opt = kf.Optimizer(keras.optimizers.SGD(1e-4))
    hook = kf.Hook(Double(), data=data, optimizer=opt)
    shapes, seen = [], []
    hook.before_train()
    for epoch in range(2):
        hook.before_epoch()
        for xb, yb, wb in data.epoch_batches():
            hook.before_step()
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(wb[:, None] * (xb @ w - yb) ** 2)
            opt.apply_gradients([(tape.gradient(loss, w), w)])
            shapes.append(int(xb.shape[0]))
            hook.after_step({"loss": float(loss)})
        hook.after_epoch()
        seen.append(hook.state.samples_seen)
    hook.after_train()
    return {"shapes": shapes, "served": [i.tolist() for i in data.served], "seen": seen,
            "batch": hook.state.local_batch_size}


def seed_form_policy():
    """A policy written as the KungFu talk prints it: hooks without the state argument (beside
    one with it), driven by kf.Hook in a custom loop. Returns how often each hook ran."""
    kf, tf, keras = _setup()

    class Seed(kf.BasePolicy):
        def __init__(self):
            self.calls = {"before_epoch": 0, "after_step": 0, "after_epoch": 0}

        def before_epoch(self):
            self.calls["before_epoch"] += 1

        def after_step(self):
            self.calls["after_step"] += 1

        def after_epoch(self, state):
            self.calls["after_epoch"] += state.epoch + 1

    x = np.arange(24, dtype=np.float32).reshape(12, 2)
    data = kf.ElasticData(x, x[:, :1], batch_size=3)
    w = tf.Variable([[0.0], [0.0]])
    opt = kf.Optimizer(keras.optimizers.SGD(1e-4))
    policy = Seed()
    hook = kf.Hook(policy, data=data, optimizer=opt)
    hook.before_train()
    for _ in range(2):
        hook.before_epoch()
        for xb, yb, wb in data.epoch_batches():
            hook.before_step()
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(wb[:, None] * (xb @ w - yb) ** 2)
            opt.apply_gradients([(tape.gradient(loss, w), w)])
            hook.after_step({"loss": float(loss)})
        hook.after_epoch()
    hook.after_train()
    return policy.calls


def talk_gns_policy(steps: int):
    """The KungFu talk's GNS policy, as printed but for a starting `prev` and a comparison that
    also asks while there is no estimate (NaN): after every step it averages the noise scale and
    asks for one worker more while it grows, in a job that is not
    elastic (so every ask is beyond the job's slots). Returns the warnings, the sizes asked for,
    and the final weights' digest."""
    import warnings

    kf, tf, keras = _setup()
    asked = []

    class GNSPolicy(kf.BasePolicy):
        def __init__(self):
            self.prev = 0.0

        def after_step(self):
            gns = kf.grad_noise_scale()
            avg = kf.allreduce(gns, "avg")
            if not avg <= self.prev:  # the talk's `avg > self.prev`; NaN (no estimate yet) too
                asked.append(kf.size() + 1)
                asked.append(kf.resize(kf.size() + 1))
            self.prev = avg

    rng = np.random.default_rng(kf.rank())
    x = rng.normal(size=(8 * steps, 4)).astype(np.float32)
    y = (x.sum(axis=1, keepdims=True) + rng.normal(size=(8 * steps, 1))).astype(np.float32)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=kf.Optimizer(keras.optimizers.SGD(0.01), monitor=["gns"]),
                  loss="mse")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[kf.Hook(GNSPolicy())])
    return {"warnings": [str(w.message) for w in caught if "kf.resize" in str(w.message)],
            "asked": asked, "size": kf.size(), "weights": _digest(model.get_weights())}
