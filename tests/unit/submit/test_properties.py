"""Java properties files as spark-submit reads them: parsing the user's, writing the run's."""

from __future__ import annotations

import stat

import pytest

from airflow_provider_torchdist.submit.properties import (
    format_properties,
    parse_properties,
    read_properties,
    spark_defaults_file,
    write_private_properties,
)


def test_the_three_separators_comments_and_blank_lines():
    text = (
        "# a comment\n"
        "! another\n"
        "\n"
        "   \t\n"
        "spark.a=1\n"
        "spark.b = 2\n"
        "spark.c:3\n"
        "spark.d   4\n"
        "  spark.e\t=\t 5  \n"
        "spark.f\n"
        "spark.g=\n"
        "  # indented comment=x\n"
    )
    assert parse_properties(text) == {
        "spark.a": "1",
        "spark.b": "2",
        "spark.c": "3",
        "spark.d": "4",
        "spark.e": "5  ",  # trailing whitespace is the value's (Spark trims it when it loads)
        "spark.f": "",
        "spark.g": "",
    }


def test_only_the_first_separator_counts():
    assert parse_properties("a = = b\nb=c=d\nc :x:y\n") == {"a": "= b", "b": "c=d", "c": "x:y"}


def test_escapes_in_keys_and_values():
    text = "k\\ ey\\=x\\:y = v\\\\w\\tx\\n\\q\nu=\\u00e9\\u20AC\\uD83D\\uDE00\n"
    assert parse_properties(text) == {"k ey=x:y": "v\\w\tx\nq", "u": "é€😀"}


def test_continuation_lines():
    text = "a=one\\\n    two \\\n\tthree\nb=x\\\\\nc=y\\\n\nd=z\\"
    assert parse_properties(text) == {"a": "onetwo three", "b": "x\\", "c": "y", "d": "z"}


def test_crlf_and_cr_line_ends_and_last_value_wins():
    assert parse_properties("a=1\r\nb=2\rc=3\na=4") == {"a": "4", "b": "2", "c": "3"}


def test_a_malformed_unicode_escape_is_refused():
    with pytest.raises(ValueError, match="malformed"):
        parse_properties("a=\\u12g4\n")


def test_read_properties_decodes_utf8(tmp_path):
    path = tmp_path / "p.conf"
    path.write_bytes("spark.app.name=trainé €\n".encode())
    assert read_properties(path) == {"spark.app.name": "trainé €"}


def test_format_escapes_what_java_would_misread():
    text = format_properties(
        {
            "spark.a": "C:\\path\\x",
            "key with = and : ": "  leading spaces kept, inner ones too",
            "spark.hash": "#!=:",
            "spark.lines": "a\nb\rc\td\fe",
            "spark.unicode": "é€😀\x00\x7f",
        }
    )
    assert text.isascii()
    assert "spark.a=C\\:\\\\path\\\\x\n" in text
    assert "key\\ with\\ \\=\\ and\\ \\:\\ =\\  leading spaces kept, inner ones too\n" in text
    assert "spark.hash=\\#\\!\\=\\:\n" in text
    assert "spark.lines=a\\nb\\rc\\td\\fe\n" in text
    assert "spark.unicode=\\u00E9\\u20AC\\uD83D\\uDE00\\u0000\\u007F\n" in text


@pytest.mark.parametrize(
    "props",
    [
        {"spark.a": "1", "spark.b": ""},
        {" lead": " lead", "trail ": "trail ", "=:#!": "=:#!", "\\": "\\\\"},
        {"multi\nline": "x\r\ny", "tab\tkey": "\ttab"},
        {"ünï": "cödé 😀 \u2028"},
        {"#comment-like": "!x", "!bang": "#y"},
    ],
)
def test_format_then_parse_gives_back_the_same(props):
    assert parse_properties(format_properties(props)) == props


def test_write_private_properties_is_0600_and_replaces(tmp_path):
    path = tmp_path / "spark.properties"
    write_private_properties(path, {"a": "1"})
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    write_private_properties(path, {"a": "2"})
    assert read_properties(path) == {"a": "2"}
    assert [p.name for p in tmp_path.iterdir()] == ["spark.properties"]  # no temporary file left


def test_spark_defaults_file_location(tmp_path):
    home, conf_dir = tmp_path / "home", tmp_path / "conf"
    (home / "conf").mkdir(parents=True)
    conf_dir.mkdir()
    assert spark_defaults_file({}, str(home)) is None  # no file there
    (home / "conf" / "spark-defaults.conf").write_text("a=1\n")
    (conf_dir / "spark-defaults.conf").write_text("a=2\n")
    assert spark_defaults_file({}, str(home)) == home / "conf" / "spark-defaults.conf"
    assert (
        spark_defaults_file({"SPARK_CONF_DIR": str(conf_dir)}, str(home)) == conf_dir / "spark-defaults.conf"
    )
    assert spark_defaults_file({}, None) is None
