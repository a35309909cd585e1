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
