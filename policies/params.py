"""The parsers of a policy's parameters: ``hpcadapt.base.parsers``' (the one home of every
numeric flag's parser, which the strategies' settings and the command line use too), under
the name policy authors import."""

from hpcadapt.base.parsers import __all__  # noqa: F401
from hpcadapt.base.parsers import *  # noqa: F401,F403
