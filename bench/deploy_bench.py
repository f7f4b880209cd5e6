"""Deploy throughput vs `scp`, side by side in one run, on loopback (a local sshd on 127.0.0.1).

    python bench/deploy_bench.py [--gib 1.0] [--repeat 2] [--sftp] | tee bench/results/deploy_bench.txt

1. A synthetic bundle the runtime's loader accepts: model.colibri of --gib GiB random fp16 weights, 8 kernels
   (cubin + PTX, ~250 KB), self-test vectors, a canonical manifest (tests/deploy/deploy_bundles.py).
2. `scp -r` of the bundle folder (OpenSSH defaults) into a fresh folder, vs `colibri-sdk deploy` into a fresh
   store (end to end: the local check of the bundle, connect, plan, upload, sha256 of every byte on the device,
   stage, switch). Alternated,
   --repeat times, each after a sync(2) (so neither starts while the other's data is still being written back);
   the best time of each is compared (time ratio <= 1.10 is the goal), and the ratios of the runs side by side.
3. A kernel-only rebuild (same weights, other kernels) deployed on top: bytes sent / bundle bytes (<= 1 %).
4. With --sftp: paramiko SFTP `put` of the same files, for reference.

Needs root and openssh-server (it starts its own sshd with throw-away keys).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "deploy"))
from deploy_bundles import write_manifest, write_weights  # noqa: E402
from sshd_server import SshServer, sshd_unavailable_reason  # noqa: E402

KERNELS = ("routing", "gate_up", "down", "small_batch")


def write_bundle(folder: Path, model: Path, kernel_seed: int) -> Path:
    """A bundle folder per the contract; model.colibri is a hard link to `model` (no second GiB on disk)."""
    folder.mkdir(parents=True)
    os.link(model, folder / "model.colibri")
    contents = {}
    kernels = []
    for name in KERNELS:
        contents[f"kernels/{name}.sm_87.cubin"] = hashlib.sha256(f"{name}{kernel_seed}".encode()).digest() * 800
        contents[f"kernels/{name}.ptx"] = f"// {name} {kernel_seed}\n".encode() * 1500
        kernels.append({"name": name, "source": f"{name}.cu", "symbols": [name], "cubin": f"kernels/{name}.sm_87.cubin",
                        "ptx": f"kernels/{name}.ptx", "defines": {}, "resources": {}})
    contents["selftest/input.npy"] = b"\x01" * 65536
    contents["selftest/output.npy"] = b"\x02" * 65536
    for rel, data in contents.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    header = json.loads((model.parent / "weights.header.json").read_text())
    write_manifest(folder, {
        "schema_version": 1, "sdk_version": "0.1.0", "arch": "sm_87", "compute_capability": [8, 7],
        "nvrtc_version": "12.9", "min_driver": 12020, "dtype": "fp16", "shape": {"batch": 1, "tokens": 16},
        "aggregation": "ordered", "profile": {"name": "deploy-bench"},
        "weights": {"file": "model.colibri", "header": header}, "kernels": kernels,
        "selftest": {"input": "selftest/input.npy", "output": "selftest/output.npy", "rtol": 0.01, "atol": 0.01},
        "files": []})
    return folder


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def run_scp(server: SshServer, known_hosts: Path, bundle: Path, dest: Path) -> float:
    start = time.perf_counter()
    subprocess.run(["scp", "-q", "-r", "-P", str(server.port), "-i", str(server.user_key),
                    "-o", f"UserKnownHostsFile={known_hosts}", "-o", "BatchMode=yes",
                    str(bundle), f"{server.user}@127.0.0.1:{dest}"], check=True)
    return time.perf_counter() - start


def run_sftp(target, bundle: Path, dest: Path) -> float:
    from colibri_sdk.deploy import Connection

    start = time.perf_counter()
    with Connection(target) as conn:
        sftp = conn.client.open_sftp()
        for p in sorted(bundle.rglob("*")):
            remote = dest / p.relative_to(bundle)
            if p.is_dir():
                sftp.mkdir(str(remote))
            else:
                sftp.put(str(p), str(remote))
        sftp.close()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0, help="size of model.colibri in GiB (default 1)")
    parser.add_argument("--repeat", type=int, default=2, help="alternated runs of scp and deploy (default 2)")
    parser.add_argument("--streams", type=int, default=2, help="deploy upload channels (default 2)")
    parser.add_argument("--sftp", action="store_true", help="also time paramiko SFTP put")
    parser.add_argument("--workdir", default=None, help="scratch folder (default: a temporary folder)")
    args = parser.parse_args()
    reason = sshd_unavailable_reason()
    if reason:
        print(f"skipped: {reason}")
        return 0
    from colibri_sdk.deploy import DeployOptions, Target, deploy

    work = Path(tempfile.mkdtemp(prefix="deploy_bench_", dir=args.workdir))
    server = SshServer.start(work / "sshd")
    try:
        known_hosts = work / "known_hosts"
        known_hosts.write_text(server.known_hosts_line())
        target = Target("127.0.0.1", server.user, server.port, str(server.user_key), str(known_hosts),
                        command_timeout=300.0)
        model = work / "weights.colibri"
        header = write_weights(model, int(args.gib * (1 << 30)), seed=0)
        (work / "weights.header.json").write_text(json.dumps({k: v for k, v in vars(header).items()
                                                              if k != "version"}))
        a = write_bundle(work / "bundle_a", model, kernel_seed=0)
        b = write_bundle(work / "bundle_b", model, kernel_seed=1)
        total = folder_bytes(a)
        print(f"bundle: {total:,} bytes ({total / 1e9:.2f} GB), {len(list(a.rglob('*.*')))} files; "
              f"loopback sshd, {os.cpu_count()} CPUs; paramiko cipher preference aes128-gcm, "
              f"{args.streams} streams; scp with OpenSSH defaults")
        scp_times, deploy_times, sftp_times = [], [], []
        for i in range(args.repeat):
            dest = work / f"scp_{i}"
            os.sync()  # neither starts with the other's dirty pages still to write back (deploy fsyncs; scp does not)
            scp_times.append(run_scp(server, known_hosts, a, dest))
            shutil.rmtree(dest)
            store = work / f"device_{i}"
            options = DeployOptions(remote_dir=str(store), remote_python=sys.executable, streams=args.streams)
            os.sync()
            start = time.perf_counter()
            result = deploy(a, target, options)
            deploy_times.append(time.perf_counter() - start)
            assert result.bytes_sent == total, (result.bytes_sent, total)
            if i + 1 < args.repeat:
                shutil.rmtree(store)
            print(f"  run {i + 1}: scp {scp_times[-1]:.2f} s ({total / scp_times[-1] / 1e6:.0f} MB/s), "
                  f"deploy {deploy_times[-1]:.2f} s ({total / deploy_times[-1] / 1e6:.0f} MB/s); load average "
                  f"{os.getloadavg()[0]:.1f}")
            if args.sftp:
                dest = work / f"sftp_{i}"
                dest.mkdir()
                sftp_times.append(run_sftp(target, a, dest))
                shutil.rmtree(dest)
                print(f"         sftp put {sftp_times[-1]:.2f} s ({total / sftp_times[-1] / 1e6:.0f} MB/s)")
        best_scp, best_deploy = min(scp_times), min(deploy_times)
        print(f"scp    best {best_scp:6.2f} s  {total / best_scp / 1e6:6.0f} MB/s")
        print(f"deploy best {best_deploy:6.2f} s  {total / best_deploy / 1e6:6.0f} MB/s  (incl. the local check, "
              f"sha256 of every byte on the device, fsync, stage, atomic switch)")
        if sftp_times:
            print(f"sftp   best {min(sftp_times):6.2f} s  {total / min(sftp_times) / 1e6:6.0f} MB/s")
        print(f"throughput ratio deploy/scp = {best_scp / best_deploy:.2f}   (goal >= 0.80); time ratio deploy/scp = "
              f"{best_deploy / best_scp:.2f}   (goal <= 1.10)")
        pairs = [d / c for d, c in zip(deploy_times, scp_times)]
        print(f"time ratio deploy/scp run by run (the same minute's load): {', '.join(f'{r:.2f}' for r in pairs)}; "
              f"median {sorted(pairs)[len(pairs) // 2]:.2f}")

        from colibri_sdk.deploy import LocalBundle

        checks = []
        for hash_files in (True, False, True, False):
            start = time.perf_counter()
            LocalBundle.open(a, hash_files=hash_files)
            checks.append(time.perf_counter() - start)
        print(f"local check before connecting: {min(checks[0::2]):.2f} s with a sha256 pass of its own (the loader's "
              f"full check), {min(checks[1::2]):.2f} s as deploy runs it (the device hashes what it "
              f"receives)")

        kernel_only = deploy(b, target, options)
        ratio = kernel_only.bytes_sent / kernel_only.total_bytes
        print(f"kernel-only re-deploy: sent {kernel_only.bytes_sent:,} of {kernel_only.total_bytes:,} bytes "
              f"= {100 * ratio:.3f} % of the bundle ({len(kernel_only.sent)} files) in {kernel_only.seconds:.2f} s"
              f"   (goal <= 1 %)")
        nothing = deploy(b, target, options)
        print(f"unchanged re-deploy: sent {nothing.bytes_sent:,} bytes in {nothing.seconds:.2f} s")
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
