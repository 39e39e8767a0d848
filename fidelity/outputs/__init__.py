"""What a run leaves behind: its directory (``rundir``), the report and plots, and N-way comparisons of runs."""
