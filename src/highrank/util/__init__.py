"""Small neutral helpers every layer may use; they import nothing else of highrank.

    checks.py    argument checks of heads, backbones and the rest (one line naming the value)
    argtypes.py  command-line option types (positive_int, ...), for cli and the analyses
    atomic.py    the one atomic file writer (temporary beside, fsync, rename, fsync folder)
    machine.py   the one description of the machine that every result record carries
    progress.py  a tqdm bar on a terminal, a plain line now and then in a log file
"""
