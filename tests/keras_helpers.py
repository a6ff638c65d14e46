"""Keras test helpers (kept apart so that tests without Keras never import it)."""

import keras


class GradientSum(keras.optimizers.Optimizer):
    """An optimizer that only adds up the gradients it is given.

    The weights never move, so every step of an epoch is differentiated at
    the same point and the sums compare exactly: with moving weights, tiny,
    ill-conditioned models (gradients up to 1e11) turn a last-bit difference
    after one step into a visible one after the next.
    """

    def __init__(self):
        super().__init__(learning_rate=0.0, name="gradient_sum")
        self.sums = []

    def build(self, variables):
        super().build(variables)
        self.sums = [self.add_variable_from_reference(v, "sum") for v in variables]

    def update_step(self, gradient, variable, learning_rate):
        self.assign_add(self.sums[self._get_variable_index(variable)], gradient)
