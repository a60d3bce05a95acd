"""`splitserve bench`: AIPerf against an OpenAI server, a sweep of loads, and a report (JSON, HTML, plots).

    command.py         the flags -> a sweep -> DIR/report.json, DIR/report.html, DIR/*.png
    workload.py        the workloads (random, shared-prefix, chat, a JSONL file) as AIPerf flags
    aiperf_driver.py   finding AIPerf, running one point, its summary JSON
    tokenizer.py       the served model's tokenizer saved where AIPerf finds it offline
    stages.py          the gateway's TTFT stage histograms from /metrics, before and after a run
    report.py          AIPerf's summary -> a run of report.json (schema splitserve-bench/1)
    plots.py, html_report.py   the PNGs (matplotlib, the `bench` extra) and the page

Nothing here is imported by `splitserve` until `bench` is chosen; matplotlib is imported only to draw.
"""
