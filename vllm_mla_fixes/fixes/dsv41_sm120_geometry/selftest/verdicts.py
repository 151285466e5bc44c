"""The self-test's verdicts and exit status (no heavy imports: the CLI reads them
before it knows that PyTorch is there)."""

PASS, FAIL = "pass", "FAIL"  # the fix's geometries
CAUGHT, MISSED = "caught", "MISSED"  # the control
BUG, NO_BUG = "bug reproduced", "no failure here"  # upstream's layout, for information

EXIT_OK, EXIT_MISMATCH, EXIT_CANNOT_RUN = 0, 1, 2
