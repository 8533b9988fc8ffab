"""The scaling report: tables (``tables``), plots (``plots``), the HTML page (``html``) and ``build.build_report``."""
