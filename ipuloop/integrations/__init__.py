"""What ipuloop offers beside its kernel: ``IPUConfig``, the experiment loggers, plotting.

The kernel (the loop, its parts and the built-in callbacks) never imports this package, a layer
above the loop (``docs/layout.md``; ``tests/loop/test_layering.py`` keeps it so). Each module here
imports the kernel's public parts and its own optional package (tensorboard, wandb, mlflow,
matplotlib) only when used:

- ``ipu_config``: ``IPUConfig`` (optimum-graphcore's settings, built into ``poptorch.Options``)
  and ``place_layers``; ``Loop(model, config)`` calls its ``to_options()`` and ``ipus_used()``;
- ``scalars``, ``tensorboard``, ``wandb_logger``, ``mlflow_logger``: ``ScalarLogger`` and the
  three loggers built on it;
- ``plotting``: curves from a ``CSVLogger`` file (``python -m ipuloop.integrations.plotting``).

Each is imported from its module (``from ipuloop.integrations.tensorboard import
TensorBoardLogger``); ``from ipuloop import IPUConfig`` imports ``IPUConfig`` on first use.
"""
