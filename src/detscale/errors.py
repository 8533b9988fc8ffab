"""The one exception type for user mistakes: the CLI prints its message, never a traceback."""


class UserError(Exception):
    """A problem the user can fix (config, dataset, command line, environment).

    The message must say what is wrong, where, and how to fix it.
    """

    exit_code = 2


#: Exit code of a run stopped by SIGTERM after writing its checkpoint (sysexits EX_TEMPFAIL):
#: "temporary failure, try again" -- rerunning resumes from weights/last.pt.
EXIT_PREEMPTED = 75

#: Exit code of a command interrupted by the user (Ctrl-C, SIGINT): 128 + 2, as a shell reports it.
EXIT_INTERRUPTED = 130
