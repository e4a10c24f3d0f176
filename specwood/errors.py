"""User-facing errors: one line that says what is wrong and how to fix it (CLI exit code 2)."""


class SpecwoodError(Exception):
    """A mistake in the user's input or environment; shown as one line, never a traceback."""


class ModelFileError(SpecwoodError):
    """A model file is missing, truncated, corrupt or of an unsupported kind."""


class ContextLengthError(SpecwoodError):
    """The prompt (plus the tokens to generate) does not fit the model's context or the cache."""


class SamplingParamsError(SpecwoodError):
    """Invalid temperature / top-k / top-p / seed / max-tokens."""


class DeadlineExceeded(SpecwoodError):
    """A request ran past its deadline (Scheduler.submit's timeout_s, `serve --request-timeout`)."""


class GrammarError(SamplingParamsError):
    """A grammar (or JSON schema) that does not compile for the model's tokenizer."""
