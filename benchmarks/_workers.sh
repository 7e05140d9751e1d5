# Sourced by the device scripts (benchmarks/studies/*_device.sh) that run several study
# processes side by side on one GPU machine.

# check_workers N: N must be a whole number from 1 to 16 (the machine's cores), else exit 2.
check_workers() {
    if ! [[ $1 =~ ^[0-9]+$ ]] || [ "$1" -lt 1 ] || [ "$1" -gt 16 ]; then
        echo "WORKERS must be a whole number from 1 to 16 (the machine's cores); got '$1'" >&2
        exit 2
    fi
}

# wait_workers: waits for every process in the array pids (worker i logs to worker_logs[i]),
# prints the last lines of each that failed, and sets status to the worst: 124 when any stopped
# at its deadline, else any failure's, else 0.
wait_workers() {
    local i code
    status=0
    for i in "${!pids[@]}"; do
        wait "${pids[$i]}"
        code=$?
        if [ "$code" -ne 0 ]; then
            echo "== ${worker_logs[$i]}: exit status $code"
            tail -n 5 "${worker_logs[$i]}"
            [ "$status" -ne 124 ] && status=$code
        fi
    done
}
