# bash completion for mtpchat. Install: copy to /usr/share/bash-completion/completions/mtpchat
# (or ~/.local/share/bash-completion/completions/mtpchat), or `source` it from ~/.bashrc.
_mtpchat() {
    local cur prev sub i
    COMPREPLY=()
    cur="${COMP_WORDS[COMP_CWORD]}"
    prev="${COMP_WORDS[COMP_CWORD-1]}"
    local commands="chat run bench pull doctor models"
    sub=""
    for ((i = 1; i < COMP_CWORD; i++)); do
        case "${COMP_WORDS[i]}" in
            chat|run|bench|pull|doctor|models) sub="${COMP_WORDS[i]}"; break ;;
        esac
    done

    case "$prev" in
        --model|--out|--prompt-file) COMPREPLY=($(compgen -f -- "$cur")); return ;;
        --device) COMPREPLY=($(compgen -W "cpu cuda" -- "$cur")); return ;;
        --dtype) COMPREPLY=($(compgen -W "float32 bfloat16 float16" -- "$cur")); return ;;
        --drafter) COMPREPLY=($(compgen -W "mtp oracle mtp,oracle" -- "$cur")); return ;;
        --random-weights) COMPREPLY=($(compgen -W "qwen3.5-27b qwen3-next-80b-a3b tiny" -- "$cur")); return ;;
        --depth|--depths|--max-new-tokens|--temperature|--top-p|--top-k|--seed|--acceptance|--acceptance-profile|--repeat|--layers|--prompt|--prompt-tokens|--system|--tp|--max-context)
            return ;;
    esac

    local opts
    case "$sub" in
        "") opts="$commands --help" ;;
        chat) opts="--model --depth --think --no-think --device --dtype --max-context --compile --tp --help" ;;
        run) opts="--prompt --prompt-file --model --system --raw --max-new-tokens --ignore-eos --depth --temperature --top-p --top-k --seed --device --dtype --max-context --compile --tp --think --no-think --think-budget --show-thinking --json --help" ;;
        bench) opts="--model --random-weights --layers --depths --drafter --acceptance --acceptance-profile --max-new-tokens --prompt --prompt-tokens --repeat --no-hf --no-graphs --temperature --top-p --top-k --precision --out --device --dtype --max-context --compile --tp --json --help" ;;
        pull) opts="--yes --quiet --dry-run --device --help qwen3.5 qwen3.6 qwen3-next qwen3.5-0.8b qwen3.5-0.8b-fp8 qwen3.5-2b qwen3.5-2b-fp8 qwen3.5-4b qwen3.5-4b-fp8 qwen3.5-9b qwen3.5-9b-fp8 qwen3.5-27b qwen3.5-27b-fp8 qwen3.5-35b-a3b qwen3.5-35b-a3b-fp8 qwen3.5-122b-a10b qwen3.5-122b-a10b-fp8 qwen3.6-27b qwen3.6-27b-fp8 qwen3.6-35b-a3b qwen3.6-35b-a3b-fp8 qwen3-next-80b-a3b-instruct qwen3-next-80b-a3b-instruct-fp8 qwen3-next-80b-a3b-thinking qwen3-next-80b-a3b-thinking-fp8" ;;
        doctor) opts="--model --device --json --help" ;;
        models) opts="--device --json --available --help"; COMPREPLY=($(compgen -d -- "$cur")) ;;
    esac
    COMPREPLY+=($(compgen -W "$opts" -- "$cur"))
}
complete -F _mtpchat mtpchat
