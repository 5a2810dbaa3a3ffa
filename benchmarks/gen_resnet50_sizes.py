"""Writes benchmarks/resnet50_sizes.json: the weight tensors of Keras' ResNet50, in model order.

The list is derived from the architecture (keras.applications.ResNet50, ImageNet head,
include_top=True, channels-last), so TensorFlow is not needed:

  conv1: 7x7/2 conv (64) + BatchNormalization
  conv2..conv5: stacks of 3, 4, 6, 3 bottleneck blocks with 64, 128, 256, 512 filters; the first
    block of each stack has a 1x1 projection shortcut (conv + BN), every block has
    1x1 (f) -> 3x3 (f) -> 1x1 (4f) convolutions, each followed by BatchNormalization
  global average pooling, Dense(1000)

Every Conv2D has a bias (Keras' ResNet builds them with use_bias=True); every
BatchNormalization has trainable gamma and beta and non-trainable moving mean and variance.

Model order is the order of the model's layers: a functional model lists its layers by
decreasing depth (longest path to the output) and, at equal depth, in the order a depth-first
walk from the output back to the input finishes them (inputs of a layer are walked in the order
they were passed). This puts, e.g., conv2_block1_0_conv (shortcut) right before
conv2_block1_3_conv. The layer graph is built below and sorted by that rule.

Run: python benchmarks/gen_resnet50_sizes.py [--check]   (--check: verify the stored file)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Dict, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "resnet50_sizes.json")

# Known totals of keras.applications.ResNet50(weights=None) (include_top=True, 1000 classes).
TRAINABLE_COUNT, TRAINABLE_TOTAL = 214, 25_583_592
ALL_COUNT, ALL_TOTAL = 320, 25_636_712


class Graph:
    """A layer graph: name -> (inbound layer names, [(weight name, shape, trainable)])."""

    def __init__(self):
        self.inbound: Dict[str, List[str]] = {}
        self.weights: Dict[str, List[Tuple[str, Tuple[int, ...], bool]]] = {}
        self.channels: Dict[str, int] = {}

    def add(self, name, inputs, out_channels, weights=()):
        assert name not in self.inbound, name
        self.inbound[name] = list(inputs)
        self.weights[name] = list(weights)
        self.channels[name] = out_channels
        return name

    def conv(self, name, x, filters, k):
        cin = self.channels[x]
        return self.add(name, [x], filters,
                        [("kernel", (k, k, cin, filters), True), ("bias", (filters,), True)])

    def bn(self, name, x):
        c = self.channels[x]
        return self.add(name, [x], c, [("gamma", (c,), True), ("beta", (c,), True),
                                       ("moving_mean", (c,), False),
                                       ("moving_variance", (c,), False)])

    def plain(self, name, x):
        return self.add(name, [x], self.channels[x])

    def model_order(self, output: str) -> List[str]:
        # Depth-first from the output: post-order finishing index of every layer.
        finish: Dict[str, int] = {}
        stack = [(output, 0)]
        seen = {output}
        while stack:
            node, i = stack.pop()
            ins = self.inbound[node]
            if i < len(ins):
                stack.append((node, i + 1))
                nxt = ins[i]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, 0))
            else:
                finish[node] = len(finish)
        # Depth: longest path from the layer to the output.
        depth = {output: 0}
        for node in sorted(finish, key=finish.get, reverse=True):  # consumers before producers
            for src in self.inbound[node]:
                depth[src] = max(depth.get(src, 0), depth[node] + 1)
        return sorted(finish, key=lambda n: (-depth[n], finish[n]))


def build_resnet50() -> Tuple[Graph, str]:
    g = Graph()
    x = g.add("input_1", [], 3)
    x = g.plain("conv1_pad", x)
    x = g.conv("conv1_conv", x, 64, 7)
    x = g.bn("conv1_bn", x)
    x = g.plain("conv1_relu", x)
    x = g.plain("pool1_pad", x)
    x = g.plain("pool1_pool", x)

    def block(x, filters, name, shortcut_conv):
        if shortcut_conv:
            sc = g.conv(name + "_0_conv", x, 4 * filters, 1)
            sc = g.bn(name + "_0_bn", sc)
        else:
            sc = x
        y = g.conv(name + "_1_conv", x, filters, 1)
        y = g.bn(name + "_1_bn", y)
        y = g.plain(name + "_1_relu", y)
        y = g.conv(name + "_2_conv", y, filters, 3)
        y = g.bn(name + "_2_bn", y)
        y = g.plain(name + "_2_relu", y)
        y = g.conv(name + "_3_conv", y, 4 * filters, 1)
        y = g.bn(name + "_3_bn", y)
        out = g.add(name + "_add", [sc, y], 4 * filters)  # Add()([shortcut, x])
        return g.plain(name + "_out", out)

    for stack, (filters, blocks) in enumerate([(64, 3), (128, 4), (256, 6), (512, 3)], start=2):
        for b in range(1, blocks + 1):
            x = block(x, filters, f"conv{stack}_block{b}", shortcut_conv=(b == 1))

    x = g.plain("avg_pool", x)
    cin = g.channels[x]
    x = g.add("predictions", [x], 1000, [("kernel", (cin, 1000), True), ("bias", (1000,), True)])
    return g, x


def tensor_list(trainable_only: bool) -> List[dict]:
    g, out = build_resnet50()
    tensors = []
    for layer in g.model_order(out):
        for wname, shape, trainable in g.weights[layer]:
            if trainable_only and not trainable:
                continue
            tensors.append({"name": f"{layer}/{wname}", "shape": list(shape),
                            "size": math.prod(shape)})
    return tensors


def build_document() -> dict:
    trainable = tensor_list(trainable_only=True)
    every = tensor_list(trainable_only=False)
    t_total = sum(t["size"] for t in trainable)
    a_total = sum(t["size"] for t in every)
    assert (len(trainable), t_total) == (TRAINABLE_COUNT, TRAINABLE_TOTAL), (len(trainable), t_total)
    assert (len(every), a_total) == (ALL_COUNT, ALL_TOTAL), (len(every), a_total)
    return {
        "model": "resnet50",
        "source": "keras.applications.ResNet50(weights=None, include_top=True, classes=1000), "
                  "trainable weights in model order",
        "generator": "benchmarks/gen_resnet50_sizes.py",
        "dtype": "float32",
        "count": len(trainable),
        "total": t_total,
        "bytes": 4 * t_total,
        "with_moving_stats": {"count": len(every), "total": a_total},
        "tensors": trainable,
    }


def dumps(doc: dict) -> str:
    # One tensor per line keeps the file readable and its diffs small.
    head = {k: v for k, v in doc.items() if k != "tensors"}
    lines = json.dumps(head, indent=2)[:-2] + ',\n  "tensors": [\n'
    lines += ",\n".join("    " + json.dumps(t) for t in doc["tensors"])
    return lines + "\n  ]\n}\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="verify the stored file instead of writing")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args(argv)
    text = dumps(build_document())
    if args.check:
        with open(args.out) as f:
            stored = f.read()
        if stored != text:
            print(f"{args.out} is out of date; run {os.path.basename(__file__)}", file=sys.stderr)
            return 1
        print(f"{args.out}: up to date ({TRAINABLE_COUNT} tensors, {TRAINABLE_TOTAL} values)")
        return 0
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {args.out}: {TRAINABLE_COUNT} tensors, {TRAINABLE_TOTAL} values")
    return 0


if __name__ == "__main__":
    sys.exit(main())
