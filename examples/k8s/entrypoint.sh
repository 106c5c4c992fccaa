#!/bin/sh
# Entry point of examples/k8s/hora-job.yaml's pods (see docs/multihost.md, "Kubernetes").
#
#   hora-entrypoint worker            install the job's ssh key, run sshd on port 2222
#   hora-entrypoint launch CMD ...    wait until every worker's sshd answers, then
#                                     hora run -np WORKERS*SLOTS -H <worker-i>.<service>:SLOTS,...
#                                     CMD ...  (the pod's exit status is the job's)
#
# Settings (plain names: hora refuses unknown HORA_* variables): JOB_WORKERS, JOB_SLOTS,
# JOB_STATEFULSET, JOB_SERVICE.
set -eu
mkdir -p /root/.ssh && chmod 700 /root/.ssh
cp /etc/hora-ssh/id_ed25519 /root/.ssh/id_ed25519 && chmod 600 /root/.ssh/id_ed25519
cp /etc/hora-ssh/id_ed25519.pub /root/.ssh/authorized_keys
chmod 600 /root/.ssh/authorized_keys

mode="$1"; shift
if [ "$mode" = worker ]; then
  [ -f /etc/ssh/ssh_host_ed25519_key ] || ssh-keygen -q -t ed25519 -N "" -f /etc/ssh/ssh_host_ed25519_key
  printf 'Port 2222\nPasswordAuthentication no\nPermitRootLogin prohibit-password\n' \
    > /etc/ssh/sshd_config.d/hora.conf
  exec /usr/sbin/sshd -D -e
fi

hosts=""
i=0
while [ "$i" -lt "$JOB_WORKERS" ]; do
  peer="${JOB_STATEFULSET}-${i}.${JOB_SERVICE}"
  until ssh -o BatchMode=yes -o StrictHostKeyChecking=no -o ConnectTimeout=3 -o LogLevel=ERROR \
        -p 2222 "$peer" true; do
    echo "waiting for $peer ..."; sleep 2
  done
  hosts="${hosts:+$hosts,}${peer}:${JOB_SLOTS}"
  i=$((i + 1))
done
exec hora run -np $((JOB_WORKERS * JOB_SLOTS)) -H "$hosts" -p 2222 --network-interface eth0 "$@"
