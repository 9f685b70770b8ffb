"""The base of every error caused by user input (config, data, paths, servers).

Its message names the field, file or row and the fix; the CLI prints it without a traceback."""


class InputError(ValueError):
    pass
