"""The `omni` command line: a thin typer layer over the library.

`main` builds the app and registers one module per command group (`run`, `graph_cmd`);
the private modules load graph files (`_load`), read request inputs (`_inputs`), print results
(`_output`), drive requests on a Runtime (`_runner`) and write to stderr (`_report`, `_errors`).
"""
