"""Every file nbsim reads or writes: `images` (SMV, raw float and PGM images, atomic writes), `text` (the
strict readers of nanoBragg's small text files and C-style numbers), `paths` (checks made on input and
output paths before any work). The package itself imports nothing, so the command line's fast answers
stay light."""
