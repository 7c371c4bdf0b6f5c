"""Every file nbsim reads or writes: `images` (SMV, raw float and PGM images, atomic writes), `text` (the
strict readers of nanoBragg's small text files and C-style numbers), `inputs` (the large input files a
configuration names), `structure_files` (HKL tables, MTZ, sf-mmCIF and atomic models through gemmi, as
full-sphere P1 tables), `paths` (checks made on input and
output paths before any work). The package itself imports nothing, so the command line's fast answers
stay light."""
