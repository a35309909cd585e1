"""prefer_installed_pyspark: the driver drops spark-submit's pyspark.zip only for the installed package's own."""

from __future__ import annotations

from pathlib import Path

from airflow_provider_torchdist.spark.node.pyspark_path import prefer_installed_pyspark


def _installed(site: Path) -> str:
    """A pip-installed pyspark under ``site``, with the zip its wheel carries; returns the zip's path."""
    lib = site / "pyspark" / "python" / "lib"
    lib.mkdir(parents=True)
    (site / "pyspark" / "__init__.py").write_text("")
    (lib / "pyspark.zip").write_bytes(b"PK")
    (lib / "py4j-0.10.9.9-src.zip").write_bytes(b"PK")
    return str(lib / "pyspark.zip")


def test_the_installed_packages_own_zip_goes_and_nothing_else(tmp_path: Path) -> None:
    site = tmp_path / "site-packages"
    zipped = _installed(site)
    py4j = str(Path(zipped).with_name("py4j-0.10.9.9-src.zip"))
    path = ["/stage/torchdist_spark.zip", zipped, py4j, "/usr/lib/python311.zip", str(site)]
    assert prefer_installed_pyspark(path, modules=()) == zipped
    assert path == ["/stage/torchdist_spark.zip", py4j, "/usr/lib/python311.zip", str(site)]


def test_a_zip_of_another_install_or_site_packages_off_the_path_stays(tmp_path: Path) -> None:
    zipped = _installed(tmp_path / "site-packages")
    # This interpreter does not have that site-packages on its path (another Python runs Spark).
    path = [zipped, "/elsewhere/site-packages"]
    assert prefer_installed_pyspark(path, modules=()) is None
    assert path == [zipped, "/elsewhere/site-packages"]
    # A Spark distribution: $SPARK_HOME/python/lib/pyspark.zip, no installed package around it.
    home = tmp_path / "spark"
    (home / "python" / "lib").mkdir(parents=True)
    (home / "python" / "lib" / "pyspark.zip").write_bytes(b"PK")
    path = [str(home / "python" / "lib" / "pyspark.zip"), str(tmp_path)]
    assert prefer_installed_pyspark(path, modules=()) is None
    assert len(path) == 2


def test_nothing_changes_once_pyspark_is_imported(tmp_path: Path) -> None:
    site = tmp_path / "site-packages"
    path = [_installed(site), str(site)]
    assert prefer_installed_pyspark(path, modules={"pyspark"}) is None
    assert len(path) == 2
