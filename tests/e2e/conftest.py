"""The e2e's driver reports are computed once a test session.

Each report is one driver process (minutes on 2 cores) that many tests read. Under pytest-xdist
every worker builds its own module fixtures, so a report whose tests were spread over two workers
would be computed twice. ``--dist loadgroup`` keeps the tests of one report on one worker (each
report's tests carry ``xdist_group``); under any distribution ``shared_report.session_report``
makes the workers of one run share a report.
"""


def pytest_configure(config):
    # pytest-xdist registers it; without xdist the marker is inert and must not warn
    config.addinivalue_line("markers", "xdist_group(name): pytest-xdist --dist loadgroup runs a group on one worker")
