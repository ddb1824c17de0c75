#!/bin/sh
# Bash and zsh completion for the three commands, generated from the built venv at build
# time (click's own completion scripts: `_KIBO_COMPLETE=bash_source kibo`), each into
# the package that ships the command.  The scripts call the command again at each <Tab>
# to complete, so they stay right for every subcommand and option of that build.
# Called by debian/rules after debian/build-venv.sh; DEBIAN is the debian/ directory.
set -eu
# Running the commands must leave no byte code in the package (Debian's Python policy).
export PYTHONDONTWRITEBYTECODE=1

DEBIAN=$1
BIN=$DEBIAN/kibotos-common/usr/lib/kibotos/venv/bin

complete_for() {  # package command
    var=_$(echo "$2" | tr 'a-z-' 'A-Z_')_COMPLETE
    bash_dir=$DEBIAN/$1/usr/share/bash-completion/completions
    zsh_dir=$DEBIAN/$1/usr/share/zsh/vendor-completions
    mkdir -p "$bash_dir" "$zsh_dir"
    if [ "$2" = kibo ]; then  # exactly what `kibo completion SHELL` prints (docs/cli.md)
        "$BIN/kibo" completion bash > "$bash_dir/$2"
        "$BIN/kibo" completion zsh > "$zsh_dir/_$2"
    else
        env "$var=bash_source" "$BIN/$2" > "$bash_dir/$2"
        env "$var=zsh_source" "$BIN/$2" > "$zsh_dir/_$2"
    fi
    grep -q "complete" "$bash_dir/$2"
}

complete_for kibotos-common kibotos
complete_for kibotos-node kibotos-node
complete_for kibotos-cli kibo
