"""The emulated device: what a wrapped model's host call does inside, beneath PopTorch's API.

PopTorch's API (``poptorch.Options``, ``trainingModel``, ``DataLoader``, ``optim``...) is
the modules one level up, named as PopTorch names them. The modules here have no name of
PopTorch's own: the device's weights and their swap into the user's module
(``device_state``), the optimizer's device copy (``optimizer_sync``), a host call's inputs
(``inputs``), outputs (``anchors``), argument binding (``signature``) and latency
(``latency``), attributes frozen as traced (``constants``), weights per replica group
(``replica_groups``), mixed precision (``precision``), automatic loss scaling
(``loss_scaling``), the gradients all-reduced across processes (``distributed``), what the
compiler refuses (``checks``, ``unsupported``), PopART's group norm grouping
(``group_norm``) and Poplar's tensor print format (``print_format``).

The API's modules import these; these import of the API only its enums, its error, its
logger, its optimizers, torch's pytree and the ``DataLoader``'s custom argument parsers.
"""
