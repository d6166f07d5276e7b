"""Benchmarks of inputaware_optim against the stock torch.optim optimizers: ``python -m benchmarks``.

``core`` defines what a section receives and returns, ``timing`` the interleaved ratio
methodology, ``models`` the models, ``sections`` one module per section (and their
registry), ``plots`` and ``report`` the outputs.
"""
