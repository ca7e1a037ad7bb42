"""One file per concept (DESIGN.md §2): reference, kernels, launchers, autograd.Function, functional, Module."""
