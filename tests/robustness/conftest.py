"""The signal tests need Ctrl-C's usual disposition: a shell starts a background job (`.ci/run &`,
`nohup`) with SIGINT ignored, and Python then installs no KeyboardInterrupt handler, in the test
process or in the children it starts (an ignored signal stays ignored across exec; a handler does not)."""

import signal

import pytest


@pytest.fixture(autouse=True)
def ctrl_c_raises_keyboard_interrupt():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
