package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"github.com/twmb/franz-go/pkg/kfake"
)

// newBenchKafkaCmd is the Kafka process that `ledger bench --kafka-process`
// starts: the in-process broker the bench otherwise runs inside itself, in
// a process of its own, so that the load generator and the tool backend
// do not share its scheduler and garbage collector, and its CPU is
// measured apart from theirs, as a deployed broker's would be.
func newBenchKafkaCmd() *cobra.Command {
	var (
		port    int
		profile string
	)
	cmd := &cobra.Command{
		Use:    "kafka",
		Short:  "Run the in-process Kafka broker for `ledger bench --kafka-process` (started by it)",
		Hidden: true,
		Args:   cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runBenchKafka(cmd.Context(), port, profile)
		},
	}
	cmd.Flags().IntVar(&port, "port", 0, "loopback port to serve Kafka on (0: any free one)")
	cmd.Flags().StringVar(&profile, "profile", "", "write a CPU profile to <profile>.cpu.pprof and an allocation profile to <profile>.allocs.pprof")
	return cmd
}

func runBenchKafka(ctx context.Context, port int, profile string) error {
	ctx, stop := signal.NotifyContext(ctx, syscall.SIGTERM, os.Interrupt)
	defer stop()
	if port < 0 || port > 65535 {
		return fmt.Errorf("--port %d: not a port", port)
	}
	if profile != "" {
		stopProfile, err := startProfiles(profile)
		if err != nil {
			return err
		}
		defer stopProfile()
	}
	cluster, err := benchKafkaCluster(kfake.Ports(port))
	if err != nil {
		return err
	}
	defer cluster.Close()
	fmt.Fprintf(os.Stderr, "kafka: serving on %v\n", cluster.ListenAddrs())
	<-ctx.Done()
	return nil
}

// benchKafkaCluster is the bench's broker, whichever process runs it.
func benchKafkaCluster(opts ...kfake.Opt) (*kfake.Cluster, error) {
	c, err := kfake.NewCluster(append([]kfake.Opt{kfake.NumBrokers(1), kfake.GroupMinSessionTimeout(time.Second)}, opts...)...)
	if err != nil {
		return nil, fmt.Errorf("start in-process kafka: %w", err)
	}
	return c, nil
}

// startKafkaProcess starts `ledger bench kafka` on a free loopback port,
// its log in dir, and waits until it accepts connections. The process
// lives in a process group of its own: a Ctrl-C stops the bench's run,
// whose cleanup still needs the broker to delete its topics, and the
// bench stops it last. It collects at Go's default GOGC, as the bench
// process that otherwise holds the broker's log does, unless the
// environment sets GOGC.
func startKafkaProcess(ctx context.Context, dir, profile string) (*benchNode, string, error) {
	addr, err := freeLoopbackAddr()
	if err != nil {
		return nil, "", err
	}
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, "", err
	}
	args := []string{"bench", "kafka", "--port", port}
	if profile != "" {
		args = append(args, "--profile", filepath.Join(profile, "kafka"))
	}
	var env []string
	if _, ok := os.LookupEnv("GOGC"); !ok {
		env = []string{"GOGC=100"}
	}
	n, err := startProcess("kafka process", "", args, env, filepath.Join(dir, "kafka.log"), true)
	if err != nil {
		return nil, "", err
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	var d net.Dialer
	for {
		conn, err := d.DialContext(ctx, "tcp", addr)
		if err == nil {
			conn.Close()
			return n, addr, nil
		}
		select {
		case <-n.exited:
			n.kill()
			return nil, "", fmt.Errorf("kafka process exited before it served (log %s)", n.log.Name())
		case <-ctx.Done():
			n.kill()
			return nil, "", fmt.Errorf("kafka process not serving on %s: %w", addr, errors.Join(ctx.Err(), err))
		case <-time.After(20 * time.Millisecond):
		}
	}
}
