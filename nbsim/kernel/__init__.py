"""The per-pixel physics and how it runs.

`inputs` (the options and tensors a kernel takes, and which sizes vary), `physics` (the fused
per-pixel functions), `ordered` (nanoBragg's loop-order behaviours, evaluated step by step),
`backends` (eager, just-in-time and ahead-of-time execution and the kernel cache) and `policy`
(when compiling pays, and building kernels for later runs).
"""
