"""The product kernels on CUDA cores: the fast loop's building blocks (:mod:`.blocks`, shared with stage 6's lessons),
the forward and preprocessing kernels (:mod:`.forward`), the backward and dQ-conversion kernels (:mod:`.backward`),
each calling the feature policies of :mod:`flashnb.kernels.policies`.  Their launchers: :mod:`flashnb.kernels.
launch.flash` (``impl="flash"``); their traffic models: :mod:`flashnb.kernels.models.simt`."""
