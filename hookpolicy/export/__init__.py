"""Stage 4, what leaves the process: Prometheus metrics, logs and tensor files, and the
operator's artefacts derived from policies (alerting rules, a Grafana dashboard).

Takes what the engine reads back each step; gives a scrape-time collector, the HTTP
exporter, JSON-lines logs and tensor files.
"""
