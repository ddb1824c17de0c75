#!/bin/sh
# kibotos Platform init (the initramfs's /init; busybox sh).  See docs/vm.md.
#
# 1. mount devtmpfs, proc, sysfs; read kibotos.* parameters from the kernel command line
# 2. load the virtio, ext4 and overlay modules in the order in /etc/kibotos/modules
# 3. find the disks by their virtio serial (and link each as /dev/disk/by-id/virtio-<serial>,
#    the name udev would give it): the Template image (read-only) and the writable
#    layer (ext4; upper/ and work/ on it), and make the root an overlay of them
# 4. move the mounts into the new root, bring the loopback interface up, start the
#    reaping init (tini) with the agent
#
# Kernel command line parameters it reads (all optional):
#   kibotos.port=NAME[,NAME…] virtio-serial ports the agent serves (org.kibotos.agent.0);
#                           the qemu backend passes the node's and the data plane's
#   kibotos.root=SERIAL     serial of the Template disk          (kibotos-root)
#   kibotos.rw=SERIAL       serial of the writable layer disk    (kibotos-rw)
#   kibotos.agent=PATH      agent program in the new root   (/usr/lib/kibotos-guest/agent.py)
#   kibotos.disks=N         wait until N virtio disks with a serial are present (2)
#   kibotos.vsock=PORT      serve the agent on this vsock port instead of virtio-serial
#                           ports, after loading /etc/kibotos/modules.vsock (Firecracker)
#   kibotos.net=1           the guest has a virtio-net NIC: load /etc/kibotos/modules.net
#                           (the agent configures it from the launch configuration)
#   kibotos.probe           print KIBOTOS-PROBE-OK and power off (acceleration probe)
# Any failure prints "kibotos-init: FAILED: <reason>" on the console and powers off.

PATH=/bin
export PATH

mount -t devtmpfs -o nosuid,mode=0755 devtmpfs /dev
mount -t proc -o nosuid,nodev,noexec proc /proc
mount -t sysfs -o nosuid,nodev,noexec sysfs /sys

log() { echo "kibotos-init: $*" > /dev/console; }
fail() {
    log "FAILED: $*"
    poweroff -f
    sleep 5
    exit 1
}
stamp() {
    # Uptime at each step, for bench/boot.py's breakdown.
    if [ -r /proc/uptime ]; then read -r up _ < /proc/uptime; else read -r up _ < /newroot/proc/uptime; fi
    log "$1 at ${up}s"
}

PORT=org.kibotos.agent.0
ROOT_SERIAL=kibotos-root
RW_SERIAL=kibotos-rw
AGENT=/usr/lib/kibotos-guest/agent.py
PROBE=
DISKS=2
VSOCK=
NET=
for arg in $(cat /proc/cmdline); do
    case "$arg" in
        kibotos.port=*) PORT="${arg#*=}" ;;
        kibotos.root=*) ROOT_SERIAL="${arg#*=}" ;;
        kibotos.rw=*) RW_SERIAL="${arg#*=}" ;;
        kibotos.agent=*) AGENT="${arg#*=}" ;;
        kibotos.disks=*) DISKS="${arg#*=}" ;;
        kibotos.vsock=*) VSOCK="${arg#*=}" ;;
        kibotos.net=1) NET=1 ;;
        kibotos.probe) PROBE=1 ;;
    esac
done

stamp "init started"
if [ -n "$PROBE" ]; then
    echo "KIBOTOS-PROBE-OK" > /dev/console
    poweroff -f
    sleep 5
    exit 0
fi

while read -r mod; do
    insmod "/lib/modules/$mod" || fail "insmod $mod"
done < /etc/kibotos/modules
if [ -n "$VSOCK" ]; then
    case "$VSOCK" in
        ''|*[!0-9]*) fail "kibotos.vsock=$VSOCK is not a port number" ;;
    esac
    while read -r mod; do
        insmod "/lib/modules/$mod" || fail "insmod $mod"
    done < /etc/kibotos/modules.vsock
fi
if [ -n "$NET" ] && [ -e /etc/kibotos/modules.net ]; then
    while read -r mod; do
        insmod "/lib/modules/$mod" || fail "insmod $mod"
    done < /etc/kibotos/modules.net
fi
stamp "modules loaded"

# virtio-mmio devices may appear after insmod returns; wait (up to ~10 s) for all of them.
count_disks() {
    n=0
    for dev in /sys/block/vd*; do
        [ -e "$dev/serial" ] && n=$((n + 1))
    done
    echo "$n"
}
find_disk() {
    for dev in /sys/block/vd*; do
        [ -e "$dev/serial" ] || continue
        serial=$(cat "$dev/serial" 2>/dev/null)
        if [ "$serial" = "$1" ]; then
            echo "${dev##*/}"
            return 0
        fi
    done
    return 1
}
tries=0
while :; do
    if [ "$(count_disks)" -ge "$DISKS" ]; then
        ROOT_DEV=$(find_disk "$ROOT_SERIAL") && RW_DEV=$(find_disk "$RW_SERIAL") && break
    fi
    tries=$((tries + 1))
    [ "$tries" -lt 200 ] || fail "found $(count_disks) of $DISKS disks; need serials $ROOT_SERIAL and $RW_SERIAL"
    usleep 50000
done
mkdir -p /dev/disk/by-id
for dev in /sys/block/vd*; do
    serial=$(cat "$dev/serial" 2>/dev/null)
    [ -n "$serial" ] && ln -sf "../../${dev##*/}" "/dev/disk/by-id/virtio-$serial"
done

mkdir -p /mnt/template /mnt/rw /newroot
mount -t ext4 -o ro,noload "/dev/$ROOT_DEV" /mnt/template || fail "mount Template image"
mount -t ext4 -o noatime "/dev/$RW_DEV" /mnt/rw || fail "mount writable layer"
mkdir -p /mnt/rw/upper /mnt/rw/work || fail "prepare writable layer"
mount -t overlay -o lowerdir=/mnt/template,upperdir=/mnt/rw/upper,workdir=/mnt/rw/work \
    overlay /newroot || fail "mount overlay root"
stamp "root mounted"

for d in dev proc sys run; do
    [ -d "/newroot/$d" ] || mkdir -p "/newroot/$d" || fail "create /$d in the new root"
done
mount -t tmpfs -o nosuid,nodev,mode=0755 tmpfs /newroot/run || fail "mount /run"
mkdir -p /newroot/run/kibotos/template /newroot/run/kibotos/rw
mount --move /mnt/template /newroot/run/kibotos/template || fail "move Template mount"
mount --move /mnt/rw /newroot/run/kibotos/rw || fail "move writable layer mount"
cp /bin/tini /newroot/run/kibotos/init || fail "install the reaping init"
for d in dev proc sys; do
    mount --move "/$d" "/newroot/$d" || fail "move /$d"
done
mkdir -p /newroot/dev/pts /newroot/dev/shm
mount -t devpts -o nosuid,noexec,gid=5,mode=620,ptmxmode=666 devpts /newroot/dev/pts
mount -t tmpfs -o nosuid,nodev,mode=1777 tmpfs /newroot/dev/shm

# The loopback interface up (the kernel gives it 127.0.0.1 and ::1): servers in the
# guest listen there, and port forwarding reaches them there, with a network or without.
ip link set lo up || fail "bring the loopback interface up"

[ -e "/newroot$AGENT" ] || fail "agent $AGENT not found in the Template"
[ -L /newroot/usr/bin/python3 ] || [ -e /newroot/usr/bin/python3 ] \
    || fail "/usr/bin/python3 not found in the Template (the agent needs it)"
stamp "starting agent"
export HOME=/root LANG=C.UTF-8
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
PORT_ARGS=
for name in $(echo "$PORT" | tr ',' ' '); do
    PORT_ARGS="$PORT_ARGS --port-name $name"
done
[ -z "$VSOCK" ] || PORT_ARGS="--vsock $VSOCK"
# shellcheck disable=SC2086  # one word per port name, by construction
exec switch_root /newroot /run/kibotos/init -- /usr/bin/python3 "$AGENT" $PORT_ARGS
