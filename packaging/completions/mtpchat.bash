# bash completion for mtpchat. Install: copy to /usr/share/bash-completion/completions/mtpchat
# (or ~/.local/share/bash-completion/completions/mtpchat), or `source` it from ~/.bashrc.
_mtpchat() {
    local cur prev sub i
    COMPREPLY=()
    cur="${COMP_WORDS[COMP_CWORD]}"
    prev="${COMP_WORDS[COMP_CWORD-1]}"
    local commands="chat run bench doctor models"
    sub=""
    for ((i = 1; i < COMP_CWORD; i++)); do
        case "${COMP_WORDS[i]}" in
            chat|run|bench|doctor|models) sub="${COMP_WORDS[i]}"; break ;;
        esac
    done

    case "$prev" in
        --model|--out|--prompt-file) COMPREPLY=($(compgen -f -- "$cur")); return ;;
        --device) COMPREPLY=($(compgen -W "cpu cuda" -- "$cur")); return ;;
        --dtype) COMPREPLY=($(compgen -W "float32 bfloat16 float16" -- "$cur")); return ;;
        --drafter) COMPREPLY=($(compgen -W "mtp oracle mtp,oracle" -- "$cur")); return ;;
        --random-weights) COMPREPLY=($(compgen -W "qwen3.5-27b qwen3-next-80b-a3b tiny" -- "$cur")); return ;;
        --depth|--depths|--max-new-tokens|--temperature|--top-p|--top-k|--seed|--acceptance|--repeat|--layers|--prompt|--system|--tp)
            return ;;
    esac

    local opts
    case "$sub" in
        "") opts="$commands --help" ;;
        chat) opts="--model --depth --device --dtype --compile --tp --help" ;;
        run) opts="--prompt --prompt-file --model --system --raw --max-new-tokens --ignore-eos --depth --temperature --top-p --top-k --seed --device --dtype --compile --tp --json --help" ;;
        bench) opts="--model --random-weights --layers --depths --drafter --acceptance --max-new-tokens --prompt --repeat --no-hf --no-graphs --temperature --top-p --top-k --precision --out --device --dtype --compile --tp --json --help" ;;
        doctor) opts="--model --device --json --help" ;;
        models) opts="--device --json --help"; COMPREPLY=($(compgen -d -- "$cur")) ;;
    esac
    COMPREPLY+=($(compgen -W "$opts" -- "$cur"))
}
complete -F _mtpchat mtpchat
