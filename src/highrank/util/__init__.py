"""Small neutral helpers every layer may use, importing nothing else of highrank: argument
checks (:mod:`~highrank.util.checks`), progress bars (:mod:`~highrank.util.progress`)."""
