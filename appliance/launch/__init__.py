"""`openarc launch claude|codex|opencode`: a coding agent set up for one served chat model.

served: which chat models a server (its /v1/models) or a config serves, each with its window, and the one to use.
clients: what each agent needs for that model (files, environment, command): pure functions, no processes.
files: writing those files into a user's own config, merged and undoable (`--restore`).
"""
