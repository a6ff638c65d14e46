"""Small forward graphs shared by the tests.

Each model has ``variables()``, which creates its ``tf.Variable`` objects
(outside any ``tf.function``), and ``forward(vs)``, which builds the forward
pass in the current graph and returns a dict with ``ys``, ``grad_ys``,
``xs`` (what to differentiate by) and ``tag`` (tensors worth checkpointing,
used for explicit lists and the 'checkpoints' collection).
"""

import numpy as np
import tensorflow as tf


def _var(rng, *shape, scale=None):
    scale = scale if scale is not None else 1.0 / np.sqrt(shape[0])
    return tf.Variable((rng.randn(*shape) * scale).astype(np.float32))


def _input(rng, *shape):
    return tf.constant(rng.randn(*shape).astype(np.float32))


class Chain:
    """tanh MLP: h <- tanh(h @ W)."""

    def __init__(self, n, width=16, batch=8):
        self.n, self.width, self.batch = n, width, batch

    def variables(self):
        rng = np.random.RandomState(1)
        return [_var(rng, self.width, self.width) for _ in range(self.n)]

    def forward(self, vs):
        h = _input(np.random.RandomState(2), self.batch, self.width)
        tag = []
        for w in vs:
            h = tf.tanh(tf.matmul(h, w))
            tag.append(h)
        return dict(ys=[tf.reduce_sum(h * h)], xs=vs, tag=tag[1:-1:3])


class ResNet:
    """Residual MLP blocks: h <- h + W2 relu(W1 h)."""

    def __init__(self, n, width=16, batch=8):
        self.n, self.width, self.batch = n, width, batch

    def variables(self):
        rng = np.random.RandomState(3)
        return [_var(rng, self.width, self.width, scale=0.1) for _ in range(2 * self.n)]

    def forward(self, vs):
        h = _input(np.random.RandomState(4), self.batch, self.width)
        tag = []
        for i in range(self.n):
            h = h + tf.matmul(tf.nn.relu(tf.matmul(h, vs[2 * i])), vs[2 * i + 1])
            tag.append(h)
        return dict(ys=[tf.reduce_mean(tf.tanh(h))], xs=vs, tag=tag[:-1:2])


class ConvBN:
    """conv -> fused batch norm (training) -> relu, three times, then a dense head."""

    def variables(self):
        rng = np.random.RandomState(5)
        vs = []
        for cin, cout in [(3, 8), (8, 8), (8, 8)]:
            vs += [_var(rng, 3, 3, cin, cout, scale=0.3),
                   tf.Variable(np.ones(cout, np.float32)), tf.Variable(np.zeros(cout, np.float32))]
        vs.append(_var(rng, 8 * 8 * 8, 4))
        return vs

    def forward(self, vs):
        h = _input(np.random.RandomState(6), 2, 8, 8, 3)
        tag = []
        for i in range(3):
            k, scale, offset = vs[3 * i:3 * i + 3]
            h = tf.nn.conv2d(h, k, strides=1, padding="SAME")
            h, _, _ = tf.compat.v1.nn.fused_batch_norm(h, scale, offset, is_training=True)
            h = tf.nn.relu(h)
            tag.append(h)
        logits = tf.matmul(tf.reshape(h, [2, -1]), vs[-1])
        return dict(ys=[tf.reduce_sum(tf.nn.softmax(logits) * tf.range(4.0))], xs=vs, tag=tag[:2])


class TwoLosses:
    """Two ys sharing a trunk, with explicit grad_ys."""

    def variables(self):
        rng = np.random.RandomState(7)
        return [_var(rng, 16, 16) for _ in range(6)]

    def forward(self, vs):
        h = _input(np.random.RandomState(8), 8, 16)
        tag = []
        for w in vs[:4]:
            h = tf.tanh(tf.matmul(h, w))
            tag.append(h)
        a = tf.reduce_sum(tf.tanh(tf.matmul(h, vs[4])), axis=1)
        b = tf.reduce_mean(tf.sigmoid(tf.matmul(h, vs[5])))
        grad_a = tf.constant(np.linspace(-1, 1, 8).astype(np.float32))
        return dict(ys=[a, b], grad_ys=[grad_a, tf.constant(3.0)], xs=vs, tag=tag[:3])


class SplitCheckpoint:
    """A tf.split output (index > 0) is the checkpoint."""

    def variables(self):
        rng = np.random.RandomState(9)
        return [_var(rng, 16, 32), _var(rng, 16, 16), _var(rng, 16, 16)]

    def forward(self, vs):
        h = tf.tanh(tf.matmul(_input(np.random.RandomState(10), 8, 16), vs[0]))
        left, right = tf.split(h, 2, axis=1)
        r = tf.tanh(tf.matmul(right, vs[1]))
        out = tf.tanh(tf.matmul(r * left, vs[2]))
        return dict(ys=[tf.reduce_sum(out)], xs=vs, tag=[right, r])


class Embedding:
    """tf.gather on an embedding table: the table's gradient is IndexedSlices."""

    def variables(self):
        rng = np.random.RandomState(11)
        return [_var(rng, 50, 16, scale=1.0), _var(rng, 16, 16), _var(rng, 16, 16)]

    def forward(self, vs):
        ids = tf.constant([1, 5, 5, 7, 49, 0, 3, 3])
        h = tf.gather(vs[0], ids)
        tag = []
        for w in vs[1:]:
            h = tf.tanh(tf.matmul(h, w))
            tag.append(h)
        # The table is also used densely once more, downstream.
        h = h + tf.gather(vs[0], tf.constant([2, 2, 4, 4, 6, 6, 8, 8]))
        return dict(ys=[tf.reduce_sum(h * h)], xs=vs, tag=tag[:1])


class Unconnected:
    """One x does not reach the ys: its gradient stays None."""

    def variables(self):
        rng = np.random.RandomState(12)
        return [_var(rng, 16, 16) for _ in range(4)]

    def forward(self, vs):
        h = _input(np.random.RandomState(13), 8, 16)
        tag = []
        for w in vs[:3]:
            h = tf.tanh(tf.matmul(h, w))
            tag.append(h)
        tf.tanh(tf.matmul(h, vs[3]))  # built, but not part of the loss
        return dict(ys=[tf.reduce_sum(h)], xs=vs, tag=tag[:2])


class Dropout:
    """Unseeded dropout and a Generator-drawn mask whose shapes depend on xs."""

    def __init__(self):
        self.generator = None

    def variables(self):
        rng = np.random.RandomState(14)
        self.generator = tf.random.Generator.from_seed(1)
        return [_var(rng, 16, 16) for _ in range(6)]

    def forward(self, vs):
        h = _input(np.random.RandomState(15), 8, 16)
        tag = []
        for i, w in enumerate(vs):
            h = tf.tanh(tf.matmul(h, w))
            # A dynamic shape (as with an unknown batch size) puts the random
            # op between xs and ys, where a naive rewrite would recompute it.
            shape = tf.raw_ops.Shape(input=h)
            if i % 2 == 0:
                h = tf.nn.dropout(h, rate=0.5, noise_shape=shape)
            else:
                h = h * tf.cast(self.generator.uniform(shape) > 0.3, tf.float32)
            tag.append(h)
        return dict(ys=[tf.reduce_sum(h * h)], xs=vs, tag=tag[1:-1:2])


@tf.function
def _nested_layer(h, w):
    return tf.tanh(tf.matmul(h, w))


class ControlFlow:
    """A tf.cond, a tf.while_loop and a nested tf.function call in the forward pass."""

    def variables(self):
        rng = np.random.RandomState(16)
        return [_var(rng, 16, 16) for _ in range(5)]

    def forward(self, vs):
        h = tf.tanh(tf.matmul(_input(np.random.RandomState(17), 8, 16), vs[0]))
        h = tf.tanh(tf.matmul(h, vs[1]))
        a = h
        h = tf.cond(tf.reduce_sum(h) > -1e9, lambda: tf.tanh(tf.matmul(h, vs[2])), lambda: h * 0.5)
        b = h

        def body(i, s):
            return i + 1, tf.tanh(tf.matmul(s, vs[3]))
        _, h = tf.while_loop(lambda i, s: i < 3, body, [tf.constant(0), h])
        c = h
        h = _nested_layer(h, vs[4])  # a nested function call (PartitionedCall)
        return dict(ys=[tf.reduce_sum(h * h)], xs=vs, tag=[a, b, c])


class StoppedX:
    """An x that is a stopped activation (``tf.stop_gradient``), read by every
    layer: its gradient is asked for, though none goes on below it."""

    def variables(self):
        rng = np.random.RandomState(16)
        return [_var(rng, 16, 16) for _ in range(6)]

    def forward(self, vs):
        stopped = tf.stop_gradient(tf.tanh(_input(np.random.RandomState(17), 8, 16)))
        h, tag = stopped, []
        for w in vs:
            h = tf.tanh(tf.matmul(h, w)) + 0.5 * stopped
            tag.append(h)
        return dict(ys=[tf.reduce_sum(h * h)], xs=[stopped] + vs, tag=tag[1:-1:2])


ALL = {
    "chain5": lambda: Chain(5),
    "chain20": lambda: Chain(20),
    "chain100": lambda: Chain(100),
    "resnet": lambda: ResNet(10),
    "convbn": ConvBN,
    "two_losses": TwoLosses,
    "split": SplitCheckpoint,
    "embedding": Embedding,
    "unconnected": Unconnected,
    "dropout": Dropout,
    "control_flow": ControlFlow,
    "stopped_x": StoppedX,
}


class UNet:
    """A U-Net: ``levels`` down (conv, relu, 2x2 max-pool) and up (2x upsample,
    concatenate the skip, conv, relu) levels. Skips bypass every tensor but
    the input and output, so there is no single-tensor bottleneck."""

    def __init__(self, levels=4, batch=2, size=32, channels=4, convs=2, norm=False):
        self.levels, self.batch, self.size, self.channels, self.convs = (
            levels, batch, size, channels, convs)
        self.norm = norm    # conv -> batch norm (training) -> relu, as most U-Nets are built

    def variables(self):
        rng = np.random.RandomState(20)
        vs, shapes = [], []
        cin = self.channels
        for i in range(self.levels):          # down
            cout = self.channels * 2 ** (i + 1)
            for j in range(self.convs):
                shapes.append((3, 3, cin if j == 0 else cout, cout))
            cin = cout
        for i in reversed(range(self.levels)):  # up
            skip = self.channels * 2 ** (i + 1)
            cout = skip
            for j in range(self.convs):
                shapes.append((3, 3, cin + skip if j == 0 else cout, cout))
            cin = cout
        for s in shapes:
            vs.append(_var(rng, *s, scale=1.0 / np.sqrt(s[0] * s[1] * s[2])))
            if self.norm:   # scale and offset of the batch norm after this conv
                vs.append(tf.Variable(1.0 + 0.1 * rng.randn(s[3]).astype(np.float32)))
                vs.append(tf.Variable(0.1 * rng.randn(s[3]).astype(np.float32)))
        vs.append(_var(rng, 1, 1, cin, 1, scale=1.0 / np.sqrt(cin)))
        return vs

    def _block(self, h, it):
        h = tf.nn.conv2d(h, next(it), 1, "SAME")
        if self.norm:
            h, _, _ = tf.compat.v1.nn.fused_batch_norm(h, next(it), next(it), is_training=True)
        return tf.nn.relu(h)

    def forward(self, vs):
        x = _input(np.random.RandomState(21), self.batch, self.size, self.size, self.channels)
        it = iter(vs)
        h, skips, tag = x, [], []
        for _ in range(self.levels):
            for _ in range(self.convs):
                h = self._block(h, it)
            skips.append(h)
            h = tf.nn.max_pool2d(h, 2, 2, "VALID")
            tag.append(h)
        for skip in reversed(skips):
            h = tf.image.resize(h, tf.shape(skip)[1:3], method="nearest")
            h = tf.concat([h, skip], axis=-1)
            for _ in range(self.convs):
                h = self._block(h, it)
            tag.append(h)
        out = tf.nn.conv2d(h, next(it), 1, "SAME")
        return dict(ys=[tf.reduce_mean(tf.square(out))], xs=vs, tag=tag[1:-1])


class DenseBlock:
    """Every layer reads the concatenation of all previous ones (DenseNet-style)."""

    def __init__(self, layers=8, batch=8, width=16, growth=16):
        self.layers, self.batch, self.width, self.growth = layers, batch, width, growth

    def variables(self):
        rng = np.random.RandomState(22)
        return [_var(rng, self.width + i * self.growth, self.growth) for i in range(self.layers)]

    def forward(self, vs):
        feats = [_input(np.random.RandomState(23), self.batch, self.width)]
        for w in vs:
            feats.append(tf.nn.relu(tf.matmul(tf.concat(feats, axis=1), w)))
        # A mean keeps gradients O(1), so float32 summation order stays far
        # below the 1e-6 tolerance.
        return dict(ys=[tf.reduce_mean(tf.tanh(tf.concat(feats, axis=1)))], xs=vs,
                    tag=feats[2:-1:2])


ALL.update({"unet": lambda: UNet(levels=3, size=16), "dense": DenseBlock,
            "unet_bn": lambda: UNet(levels=3, size=16, norm=True)})
