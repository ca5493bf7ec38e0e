package main

import (
	"fmt"
	"io"
	"slices"
	"strings"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
)

// configRefPath is where the generated configuration reference is kept,
// relative to the repository's root; a test keeps it in step with the
// flags.
const configRefPath = "deploy/CONFIG.md"

func newConfigRefCmd() *cobra.Command {
	return &cobra.Command{
		Use:    "config-reference",
		Short:  "Print the configuration reference (every command's flags and their LEDGER_* variables) as Markdown",
		Hidden: true,
		Args:   cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return writeConfigRef(cmd.OutOrStdout(), cmd.Root())
		},
	}
}

// envName is the variable bindEnv reads for a flag.
func envName(flag string) string {
	return "LEDGER_" + strings.ToUpper(strings.ReplaceAll(flag, "-", "_"))
}

// writeConfigRef writes the reference of root's flags: the global ones
// once, then each command's own, in command order.
func writeConfigRef(w io.Writer, root *cobra.Command) error {
	var b strings.Builder
	b.WriteString("# Configuration reference\n\n")
	b.WriteString("Generated from the flags by `ledger config-reference` (`make config-reference`); do not edit by hand.\n\n")
	b.WriteString("Every flag can also be set by the environment variable named after it: `--kafka-brokers` is `LEDGER_KAFKA_BROKERS`. ")
	b.WriteString("A flag on the command line wins over the variable, which wins over the default. ")
	b.WriteString("Flags marked (flag only) take no variable: `ledger dev` takes what names a deployment's stores, tools, secrets and keys from its command line alone, so that started in a shell set up for a deployment it does not open that deployment's. ")
	b.WriteString("Secrets (passwords, tokens) belong in variables or files, not on command lines, which other users of the machine can read.\n\n")
	b.WriteString("## Global flags\n\nAccepted by every command.\n\n")
	writeFlagTable(&b, root.PersistentFlags())
	var walk func(c *cobra.Command)
	walk = func(c *cobra.Command) {
		for _, sub := range c.Commands() {
			if sub.Hidden || sub.Name() == "help" || sub.Name() == "completion" {
				continue
			}
			local := sub.LocalFlags()
			if local.HasAvailableFlags() || sub.Runnable() {
				fmt.Fprintf(&b, "## `%s`\n\n%s\n\n", sub.CommandPath(), sub.Short)
				if local.HasAvailableFlags() {
					writeFlagTable(&b, local)
				}
			}
			walk(sub)
		}
	}
	walk(root)
	_, err := io.WriteString(w, b.String())
	return err
}

// machineDefault describes a default that differs from one machine to
// the next, so that the reference is the same wherever it is generated.
func machineDefault(flag string) (string, bool) {
	if flag == "instance-id" {
		return "(the host name)", true
	}
	return "", false
}

func writeFlagTable(b *strings.Builder, fs *pflag.FlagSet) {
	var flags []*pflag.Flag
	fs.VisitAll(func(f *pflag.Flag) {
		if !f.Hidden && f.Name != "help" {
			flags = append(flags, f)
		}
	})
	slices.SortFunc(flags, func(a, b *pflag.Flag) int { return strings.Compare(a.Name, b.Name) })
	b.WriteString("| Flag | Variable | Default | Meaning |\n|---|---|---|---|\n")
	for _, f := range flags {
		def := f.DefValue
		if f.Value.Type() == "stringSlice" {
			def = strings.Trim(def, "[]")
		}
		if def != "" {
			def = "`" + def + "`"
		}
		if d, ok := machineDefault(f.Name); ok {
			def = d
		}
		env := "`" + envName(f.Name) + "`"
		if f.Annotations[explicitOnly] != nil {
			env = "(flag only)"
		}
		fmt.Fprintf(b, "| `--%s` | %s | %s | %s |\n", f.Name, env, def, strings.ReplaceAll(f.Usage, "|", `\|`))
	}
	b.WriteString("\n")
}
