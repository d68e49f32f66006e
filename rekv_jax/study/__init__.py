"""The study: experiments, link calibration, sweeps, records, statistics, reports, benchmarks and
the doctor."""
