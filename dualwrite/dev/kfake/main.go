// Command kfake runs franz-go's kfake, an independent in-memory implementation of the Kafka
// protocol, as one broker on a loopback port, for dualwrite's compatibility tests
// (`dualwrite dev up --flavour kfake`). It prints "listening HOST:PORT" once it accepts
// connections and stops on SIGTERM or SIGINT.
package main

import (
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kversion"
)

type brokerConfigs map[string]string

func (f brokerConfigs) String() string { return "" }

func (f brokerConfigs) Set(s string) error {
	k, v, ok := strings.Cut(s, "=")
	if !ok {
		return fmt.Errorf("expected key=value, got %q", s)
	}
	f[k] = v
	return nil
}

func main() {
	port := flag.Int("port", 0, "port on 127.0.0.1 (0 picks a free one)")
	dataDir := flag.String("data-dir", "", "persist the log here (survives a restart)")
	logLevel := flag.String("log-level", "warn", "none, error, warn, info or debug")
	asVersion := flag.String("as-version", "", "offer only the requests of this Kafka release (e.g. 2.8)")
	configs := make(brokerConfigs)
	flag.Var(configs, "c", "broker config key=value (repeatable)")
	flag.Parse()

	level := map[string]kfake.LogLevel{
		"none": kfake.LogLevelNone, "error": kfake.LogLevelError, "warn": kfake.LogLevelWarn,
		"info": kfake.LogLevelInfo, "debug": kfake.LogLevelDebug,
	}[strings.ToLower(*logLevel)]
	opts := []kfake.Opt{
		kfake.Ports(*port),
		kfake.AllowAutoTopicCreation(),
		kfake.WithLogger(kfake.BasicLogger(os.Stderr, level)),
	}
	if *dataDir != "" {
		opts = append(opts, kfake.DataDir(*dataDir), kfake.SyncWrites())
	}
	if *asVersion != "" {
		versions := kversion.FromString(*asVersion)
		if versions == nil {
			fmt.Fprintf(os.Stderr, "kfake: unknown Kafka version %q\n", *asVersion)
			os.Exit(2)
		}
		opts = append(opts, kfake.MaxVersions(versions))
	}
	if len(configs) > 0 {
		opts = append(opts, kfake.BrokerConfigs(configs))
	}
	cluster, err := kfake.NewCluster(opts...)
	if err != nil {
		fmt.Fprintf(os.Stderr, "kfake: %v\n", err)
		os.Exit(1)
	}
	for _, addr := range cluster.ListenAddrs() {
		fmt.Printf("listening %s\n", addr)
	}
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	<-sigs
	cluster.Close()
}
