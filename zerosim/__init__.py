"""zerosim: train LLM search agents against a simulated search engine.

The package shows its layers (docs/architecture.md): ``core`` (foundation) < ``agent`` < the components
(the top-level packages ``simulators``, ``eval``, ``curricula``) < the apps: ``engines`` (``search.engine`` -> an
engine), ``job_config``, ``training``, ``experiment`` and ``cli``. Each imports only from the layers below it
(``lint-imports`` checks it), and every module here belongs to one of them.
"""

__version__ = "0.1.0"
