"""The per-pixel physics and how it runs.

`inputs` (the options and tensors a kernel takes, and which sizes vary), `physics` (the fused
per-pixel functions), `ordered` (nanoBragg's loop-order behaviours, evaluated step by step), `stages`
(the stage pipelines, `Structure`, `StageVariant`), `cache` (`KernelCache`: packages, keys, locks),
`aot` (export, build and open ahead-of-time packages), `inductor_patches` (what Inductor has no option
for), `jit` (torch.compile), `dispatch` (`kernel_callable`: eager, jit or aot), `structure` (`structure_of`:
a configuration's structure without resolving it), `policy` (when compiling pays) and `build` (a
structure's packages built in a process of their own). The `Compile` and `Mode` enums are in
nbsim.modes.
"""
