"""The tests that compute in 16-bit floats on the CPU (marked half_precision)
pass under each of the CPU's kernel sets, not only under the best one it
offers: their rounding is the kernels' (a bfloat16 test once passed under
AVX-512 and failed under AVX2). ATen picks its kernels when a process starts
(ATEN_CPU_CAPABILITY), so each other set runs them in a process of its own."""

import subprocess
import sys

import pytest
import torch
from helpers import ENV, REPO

pytestmark = pytest.mark.slow  # a process for each kernel set

# ATen's kernel sets on x86-64, each a subset of the next
KERNEL_SETS = ["default", "avx2", "avx512"]
OWN = torch.backends.cpu.get_cpu_capability().lower()
OTHERS = KERNEL_SETS[:KERNEL_SETS.index(OWN)] if OWN in KERNEL_SETS else []  # those this CPU offers beside its own


def unless_other(kernels):
    reason = "this process's own: the suite runs them with these" if kernels == OWN else "not this CPU's"
    return pytest.mark.skipif(kernels not in OTHERS, reason=reason)


@pytest.mark.parametrize("kernels", [pytest.param(k, marks=unless_other(k)) for k in KERNEL_SETS])
def test_half_precision_tests_pass_with_each_kernel_set_of_the_cpu(kernels):
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--tb=short", "-m", "half_precision",
                           "tests"], capture_output=True, text=True, cwd=REPO, env=dict(ENV, ATEN_CPU_CAPABILITY=kernels))
    output = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert f"CPU kernels: {kernels.upper()}" in proc.stdout, output
    if proc.returncode != 0:  # its own report, not this test's traceback around it
        pytest.fail(f"ATEN_CPU_CAPABILITY={kernels} pytest -m half_precision tests:\n{output}", pytrace=False)
