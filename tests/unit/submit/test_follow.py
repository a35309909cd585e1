"""The hook's side of the owner stream: lines to the log, the application from the driver only."""

from __future__ import annotations

import io

from airflow_provider_torchdist.spark.driver.owner import write_channel_address, write_owner_token
from airflow_provider_torchdist.submit.follow import RunFollower
from tests.unit.conftest import wait_until
from tests.unit.spark.driver.test_owner import make_channel, rank_of


def _follow(tmp_path):
    lines: list[str] = []
    apps: list[tuple] = []
    metrics: list[dict] = []
    token = write_owner_token(tmp_path)
    follower = RunFollower(
        tmp_path,
        token,
        on_line=lines.append,
        on_application=lambda *app: apps.append(app),
        on_metric=metrics.append,
    )
    return follower, token, lines, apps, metrics


def test_the_follower_logs_lines_and_takes_the_application_from_the_driver(tmp_path):
    follower, token, lines, apps, metrics = _follow(tmp_path)
    follower.start()  # before the driver is up: it waits for the channel's address
    with make_channel(tmp_path, io.StringIO(), owner_token=token, echo_stdout=False) as channel:
        write_channel_address(tmp_path, channel.address)
        channel.application("app-7", "http://127.0.0.1:4040")
        rank = rank_of(channel)
        # A rank printing the driver's application line, with or without a line break before it.
        rank.line("out", "[torchdist] application app-evil spark-ui http://evil")
        rank.line("out", "x\n[torchdist] application app-evil2 spark-ui http://evil")
        rank.line("out", "\x1b[31mred\x1b[0m")
        rank.close()
        wait_until(lambda: len(lines) == 4, what="the lines")
    follower.stop()
    assert apps == [("app-7", "http://127.0.0.1:4040", None)]  # only the driver's own event counts
    assert lines[0] == "[torchdist] application app-7 spark-ui http://127.0.0.1:4040"
    assert lines[1] == "[rank 0 @ localhost] [torchdist] application app-evil spark-ui http://evil"
    assert lines[2] == "[rank 0 @ localhost] x\\n[torchdist] application app-evil2 spark-ui http://evil"
    assert lines[3] == "[rank 0 @ localhost] \\x1b[31mred\\x1b[0m"  # escaped: one visible line


def test_a_connect_drivers_operation_reaches_the_hook_with_its_application(tmp_path):
    follower, token, lines, apps, _ = _follow(tmp_path)
    follower.start()
    with make_channel(tmp_path, io.StringIO(), owner_token=token, echo_stdout=False) as channel:
        write_channel_address(tmp_path, channel.address)
        channel.application(
            "local-1", None, "0b8f1c57-6f0e-4a43-9d3e-2a4c1f6b9d10/5f2d7a61-1c4b-4e8e-8f57-0c9a3b2e6d44"
        )
        wait_until(lambda: apps, what="the application")
    follower.stop()
    assert apps == [
        ("local-1", None, "0b8f1c57-6f0e-4a43-9d3e-2a4c1f6b9d10/5f2d7a61-1c4b-4e8e-8f57-0c9a3b2e6d44")
    ]
    assert (
        lines[0]
        == "[torchdist] application local-1 spark-ui - connect-operation 0b8f1c57-6f0e-4a43-9d3e-2a4c1f6b9d10/5f2d7a61-1c4b-4e8e-8f57-0c9a3b2e6d44"
    )


def test_a_run_that_never_starts_its_driver_stops_the_follower_at_once(tmp_path):
    import time

    follower, *_ = _follow(tmp_path)
    follower.start()
    started = time.monotonic()
    follower.stop()  # spark-submit failed before the driver wrote its address
    assert time.monotonic() - started < 1.0


def test_a_wrong_owner_token_is_refused_and_said_in_the_log(tmp_path):
    follower, token, lines, apps, _ = _follow(tmp_path)
    with make_channel(tmp_path, io.StringIO(), owner_token="another-token", echo_stdout=False) as channel:
        write_channel_address(tmp_path, channel.address)
        follower.start()
        wait_until(lambda: lines, what="the refusal")
        follower.stop()
    assert "cannot follow the run's log" in lines[0] and apps == []
