"""Worker bodies for test_join.py: uneven data with join (the numpy core and kungfu.torch).
Each body returns raw values; the tests compute what they must be from the inputs below."""
from __future__ import annotations

import os
import threading
import time

import numpy as np

import kungfu as kf
from _w_kungfu_names import error_of


# -- inputs (pure numpy, shared with the tests) -------------------------------------------------

def a_of(r: int) -> np.ndarray:
    return np.arange(5, dtype=np.float64) * (r + 1) - 3


def b_of(r: int) -> np.ndarray:
    return (np.arange(17, dtype=np.int64) * 7 * (r + 1)) % 23 - 11  # negative values too


def steps_of(r: int, n: int, epoch: int) -> int:
    """Worker r's number of batches in an epoch: more for higher ranks in epoch 0, fewer in 1."""
    return r + 2 if epoch == 0 else n - r + 1


def grad_of(r: int, epoch: int, step: int) -> np.ndarray:
    return np.full(4, 100.0 * epoch + 10 * r + step + 1)


def rows_of(r: int) -> np.ndarray:
    return np.full((r + 1, 2), float(r))


def batch_of(r: int, step: int) -> np.ndarray:
    """Worker r's step-th batch for the torch model (3 samples of 3 features)."""
    return np.arange(9, dtype=np.float32).reshape(3, 3) * (r + 1) + step


def torch_steps(r: int) -> int:
    return r + 1


LR = 0.1
W0 = np.array([0.5, -1.0, 2.0], np.float32)


# -- workers ------------------------------------------------------------------------------------

def _horovod_cases(r: int, n: int) -> list:
    """Horovod's join test: each rank in turn joins first; the others average two tensors. With
    `warm`, every rank averages them once before (the joined one has then issued use 0 of both
    names itself: it serves only the later uses)."""
    out = []
    for warm in (False, True):
        for first in range(n):
            got = {}
            with kf.Join() as j:
                if warm:
                    got["warm"] = kf.allreduce(a_of(r), "avg", name="tensor_a")
                    kf.allreduce(b_of(r), "avg", name="tensor_b")
                if r != first:
                    ha = kf.allreduce_async(a_of(r), "avg", name="tensor_a")
                    hb = kf.allreduce_async(b_of(r), "avg", name="tensor_b")
                    got.update(a=ha.wait(), b=hb.wait())
            got["ret"] = j.last_joined
            got["everywhere"] = kf.allgather_object(j.last_joined)
            out.append(got)
    return out


def _epochs(r: int, n: int) -> dict:
    """Two epochs of uneven batches in one Join block, each ended by join()."""
    sums, avgs, rets = [], [], []
    with kf.Join() as block:
        for epoch in (0, 1):
            s, a = [], []
            for step in range(steps_of(r, n, epoch)):
                if (epoch, step, r) == (0, 2, n - 1):
                    # Stalls past the mismatch grace (ENV) while rank 0 has joined and waits in a
                    # round (and at np 3 rank 1 waits in "grad"): not a mismatch.
                    time.sleep(1.5)
                s.append(kf.allreduce(grad_of(r, epoch, step), name="grad"))
                a.append(kf.allreduce(grad_of(r, epoch, step), "avg", name="grad_avg"))
            sums.append(s)
            avgs.append(a)
            rets.append(kf.join())
    after = kf.allreduce(np.array([r + 1.0]), name="after")  # the job goes on with everyone
    return {"sums": sums, "avgs": avgs, "rets": rets, "block": block.last_joined,
            "after": after}


def _others(r: int, n: int) -> dict:
    """Rank 0 joins at once; the others try the other collectives while it has joined."""
    got = {}
    with kf.Join() as j:
        if r != 0:
            got["max"] = kf.allreduce(a_of(r), "max", name="max")
            got["min"] = kf.allreduce(b_of(r), "min", name="min")
            got["allgather"] = kf.allgather(rows_of(r), name="ag")
            got["broadcast"] = kf.broadcast(a_of(r), root=1, name="bc")
            kf.barrier(name="bar")
            got["broadcast from 0"] = error_of(lambda: kf.broadcast(a_of(r), root=0, name="bc0"))
            got["alltoall"] = error_of(lambda: kf.alltoall(rows_of(0) + r, name="a2a",
                                                         splits=[1] + [0] * (n - 1)))
            got["after errors"] = kf.allreduce(a_of(r), name="sum")
    got["ret"] = j.last_joined
    with kf.Join() as alone:  # only the last rank has data: every other one has joined
        if r == n - 1:
            got["alone broadcast"] = error_of(lambda: kf.broadcast(a_of(r), root=0, name="bc0b"))
            got["alone sum"] = kf.allreduce(a_of(r), name="alone")
    got["alone ret"] = alone.last_joined
    return got


def _torch(r: int, n: int) -> dict:
    import torch

    import kungfu.torch as kt

    model = torch.nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.from_numpy(W0).reshape(1, 3))
    opt = kt.optimizers.SynchronousSGDOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                                model.named_parameters())
    with kt.Join() as j:
        for step in range(torch_steps(r)):
            opt.zero_grad()
            model(torch.from_numpy(batch_of(r, step))).sum().backward()
            opt.step()
        mine = model.weight.detach().numpy().reshape(-1).copy()
        ret = kt.join()
    kt.broadcast_parameters(model.state_dict(), root=ret)
    out = {"mine": mine, "ret": ret, "block": j.last_joined,
           "final": model.weight.detach().numpy().reshape(-1).copy()}
    # PyTorch's form, Join([model, optimizer]): the block ends with the last joined rank's
    # weights and momentum everywhere.
    model = torch.nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.from_numpy(W0).reshape(1, 3))
    opt = kt.optimizers.SynchronousSGDOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), model.named_parameters())
    with kt.Join([model, opt]):
        for step in range(torch_steps(r)):
            opt.zero_grad()
            model(torch.from_numpy(batch_of(r, step))).sum().backward()
            opt.step()
        out["own"] = model.weight.detach().numpy().reshape(-1).copy()
    out["synced"] = model.weight.detach().numpy().reshape(-1).copy()
    out["momentum"] = opt.state[model.weight]["momentum_buffer"].numpy().reshape(-1).copy()
    out["bad"] = [error_of(lambda: kt.Join([object()])),
                  error_of(lambda: kt.Join(throw_on_early_termination=True))]
    return out


def uneven(with_torch: bool = True) -> dict:
    r, n = kf.rank(), kf.size()
    out = {"horovod": _horovod_cases(r, n), "epochs": _epochs(r, n), "others": _others(r, n),
           "outside": error_of(kf.join)}
    if with_torch:
        out["torch"] = _torch(r, n)
    return out


def joined_dies() -> dict:
    """Rank 1 joins and dies while it serves; rank 0's collectives must fail naming it."""
    if kf.rank() == 1:
        threading.Timer(1.0, os._exit, (3,)).start()
        with kf.Join():
            kf.join()
        time.sleep(60)  # never reached: the timer ends the process while it serves
    got = {}

    def run():
        with kf.Join():
            got["first"] = kf.allreduce(np.ones(3), name="before")
            time.sleep(3)  # rank 1 is gone by now (os._exit above)
            kf.allreduce(np.ones(3), name="after")
    got["error"] = error_of(run)
    return got


def fit_steps(r: int, n: int, epoch: int) -> int:
    """Worker r's batches in model.fit's epoch: rank n - 1 joins last in epoch 0, rank 0 in the
    next ones."""
    return r + 1 if epoch == 0 else n - r


def tf_uneven() -> dict:
    """TensorFlow inside kf.Join, rank r with r + 1 batches: kf.Optimizer in an eager custom loop
    and in a tf.function traced inside the block, DistributedGradientTape; the last rank, alone,
    also an allreduce of max, a traced allreduce and a broadcast (refused). Then model.fit with
    kf.JoinCallback, fit_steps(r, n, epoch) batches of a dataset of unknown length, and with
    kf.Hook (refused)."""
    import keras
    import tensorflow as tf

    from kungfu.tensorflow import ops

    r, n = kf.rank(), kf.size()
    got = {}

    def loss_of(x, w):
        return tf.reduce_sum(tf.linalg.matvec(x, w))

    w = tf.Variable(W0)
    opt = kf.Optimizer(keras.optimizers.SGD(LR))
    with kf.Join() as j:
        for step in range(torch_steps(r)):
            with tf.GradientTape() as tape:
                loss = loss_of(tf.constant(batch_of(r, step)), w)
            opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))
        got["mine"] = w.numpy().copy()
        if r == n - 1:  # the others have joined by now
            got["max"] = ops.all_reduce(tf.constant(a_of(r)), "max", name="tf_max").numpy()
            got["traced alone"] = tf.function(
                lambda: ops.all_reduce(tf.constant(a_of(r)), name="traced"))().numpy()
            got["broadcast"] = error_of(lambda: ops.broadcast(tf.constant(1.0), name="tf_bc"))
            got["traced broadcast"] = error_of(tf.function(
                lambda: ops.broadcast(tf.constant(1.0), name="tf_bc")))
        got["ret"] = kf.join()
    got["block"] = j.last_joined
    v, sgd = tf.Variable(W0), keras.optimizers.SGD(LR)  # Horovod's tape, a plain optimizer
    with kf.Join():
        for step in range(torch_steps(r)):
            with tf.GradientTape() as tape:
                loss = loss_of(tf.constant(batch_of(r, step)), v)
            grads = kf.DistributedGradientTape(tape).gradient(loss, [v])
            sgd.apply_gradients(zip(grads, [v]))
        got["tape"] = v.numpy().copy()
    u, traced_opt = tf.Variable(W0), kf.Optimizer(keras.optimizers.SGD(LR))

    @tf.function
    def traced_step(x):
        with tf.GradientTape() as tape:
            loss = loss_of(x, u)
        traced_opt.apply_gradients(zip(tape.gradient(loss, [u]), [u]))

    with kf.Join():
        for step in range(torch_steps(r)):
            traced_step(tf.constant(batch_of(r, step)))
    got["traced"] = u.numpy().copy()
    got.update(_tf_fit(r, n))
    return got


def _tf_fit(r: int, n: int) -> dict:
    import keras
    import tensorflow as tf

    epochs = iter(range(3))

    def batches():  # called once per epoch by tf.data
        epoch = next(epochs)
        for step in range(fit_steps(r, n, epoch)):
            yield batch_of(r, 10 * epoch + step), np.zeros((3, 1), np.float32)

    spec = (tf.TensorSpec((3, 3), tf.float32), tf.TensorSpec((3, 1), tf.float32))
    data = tf.data.Dataset.from_generator(batches, output_signature=spec)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, use_bias=False)])
    model.layers[0].kernel.assign(W0[:, None])
    model.compile(optimizer=kf.Optimizer(keras.optimizers.SGD(LR)),
                  loss=lambda y, p: tf.reduce_sum(p))
    join = kf.JoinCallback()
    history = model.fit(data, epochs=2, verbose=0, callbacks=[
        kf.BroadcastGlobalVariablesCallback(), kf.MetricAverageCallback(), join])
    out = {"fit": model.layers[0].kernel.numpy()[:, 0].copy(),
           "fit iterations": int(model.optimizer.iterations.numpy()),
           "fit last": join.last_joined, "fit loss": history.history["loss"]}
    again = kf.JoinCallback()  # a second fit keeps the function traced in the first one's block
    model.fit(data, epochs=1, verbose=0, callbacks=[again])
    out.update({"fit again": model.layers[0].kernel.numpy()[:, 0].copy(),
                "fit again last": again.last_joined})
    out["with hook"] = error_of(lambda: model.fit(
        data, epochs=1, verbose=0, callbacks=[kf.Hook(), kf.JoinCallback()]))
    return out
