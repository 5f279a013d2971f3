"""`fsdp-bridge migrate`: rewrite a training repository between FSDP dialects with libcst.

cli.py      argument parsing, modes (--diff/--write/--check), exit codes, summary line
files.py    the file walker (.gitignore, --exclude) and the prefilter that skips files which
            cannot contain FSDP usage before they are parsed
driver.py   runs one codemod over one file (in worker processes for -j N), atomic writes
report.py   the --report writer (.json or .md)
runtime.py  helpers the rewritten code imports: FSDP1 values translated at run time
"""
