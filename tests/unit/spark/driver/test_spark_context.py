"""``first_line``: the line of a Spark error that says what went wrong, over either engine."""

from __future__ import annotations

from airflow_provider_torchdist.spark.driver.spark_context import first_line


def test_spark_connects_error_condition_wins_over_the_jvm_stack_trace() -> None:
    text = (
        "[TABLE_OR_VIEW_NOT_FOUND] The table or view `db`.`missing` cannot be found. SQLSTATE: 42P01;\n"
        "'UnresolvedRelation [db, missing], [], false\n\n"
        "JVM stacktrace:\norg.apache.spark.sql.catalyst.ExtendedAnalysisException\n\tat org.apache..."
    )
    assert first_line(Exception(text)) == (
        "[TABLE_OR_VIEW_NOT_FOUND] The table or view `db`.`missing` cannot be found. SQLSTATE: 42P01;"
    )


def test_without_a_condition_the_first_line_naming_an_exception() -> None:
    text = "An error occurred while calling o42.collect.\n: java.lang.IllegalStateException: boom\n\tat x"
    assert first_line(Exception(text)) == ": java.lang.IllegalStateException: boom"
    assert first_line(Exception("plain words")) == "plain words"


def test_a_python_workers_error_is_its_tracebacks_last_line() -> None:
    """As Spark Connect's client got it in stop 40's CI, where the log said only 'Traceback (most
    recent call last):'; the JVM's frames follow the Python ones."""
    text = (
        "Job aborted due to stage failure: Could not recover from a failed barrier ResultStage.\n"
        "org.apache.spark.api.python.PythonException: [PYTHON_EXCEPTION] An exception was thrown from "
        "the Python worker: Traceback (most recent call last):\n"
        '  File "/x/pyspark.zip/pyspark/worker.py", line 3602, in main\n'
        "    func, profiler, deserializer, serializer = read_udfs(\n"
        "                                               ^^^^^^^^^^\n"
        "FileNotFoundError: [Errno 2] No such file or directory: '/tmp/torchdist-connect-12-ab'\n"
        " SQLSTATE: 38000\n"
        "\tat org.apache.spark.api.python.BasePythonRunner$ReaderIterator.handlePythonException(...)\n"
        "\n\nJVM stacktrace:\norg.apache.spark.SparkException: Job aborted\n"
    )
    assert first_line(Exception(text)) == (
        "a Spark task's Python worker failed: "
        "FileNotFoundError: [Errno 2] No such file or directory: '/tmp/torchdist-connect-12-ab'"
    )


def test_of_chained_tracebacks_the_last_one_raised() -> None:
    text = (
        "[PYTHON_EXCEPTION] worker failed: Traceback (most recent call last):\n  File 'a', line 1\n"
        "KeyError: 'k'\n\nDuring handling of the above exception, another exception occurred:\n\n"
        "Traceback (most recent call last):\n  File 'b', line 2\n    raise ValueError('bad')\n"
        "ValueError: bad\n"
    )
    assert first_line(Exception(text)) == "a Spark task's Python worker failed: ValueError: bad"
