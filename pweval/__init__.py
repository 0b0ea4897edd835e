"""Serving-time evaluation of the PagedWeight runtime (SPEC section 8).

What it does, one module per concept:
- ``workload``: requests from real text (prompt + teacher-forced continuation), labelled by task;
- ``retrieval``: LongBench-style passage retrieval built from WikiText-2 paragraphs, scored by likelihood;
- ``meetings``: QMSum meeting transcripts as long-context perplexity windows;
- ``scoring``: one workload through the runtime under a budget and policy, or through the 16-bit
  (or dense b-bit) reference model, giving log p of every continuation token;
- ``memory``: footprints of the static deployments (16-bit, uniform b) for the same workload;
- ``results``: the results table (declared Parquet schema, atomic appends);
- ``runs``: one run -> one results row; ``sweep``: every policy x budget; ``figures``: plots and
  markdown tables from the results table; ``notebooks``: run the analysis notebooks headless.
It does not calibrate (``pwcal``) and does not change the runtime's behaviour.
"""
