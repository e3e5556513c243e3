"""Commands, apart from the runtime: ``cli`` (the ``dsv4-ops`` command), ``doctor`` (deployment
checks), ``selftest`` (``dsv4-ops check``). Nothing under ``dsv4_ops`` outside this folder imports it."""
