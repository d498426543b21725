package main

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/spf13/cobra"
)

// deleted is an entry of a delete report.
type deleted struct {
	ID      string `json:"id"`
	Topic   string `json:"topic"`
	Handler string `json:"handler"`
	Reason  string `json:"reason"`
}

// deleteReport is the JSON document of dlq delete.
type deleteReport struct {
	Broker  string    `json:"broker"`
	Topic   string    `json:"topic"`
	Group   string    `json:"group"`
	Deleted []deleted `json:"deleted"`
	Kept    []kept    `json:"kept"`
	// NotFound lists the --id values that matched no dead letter.
	NotFound []string `json:"not_found"`
	// Limited is true when the delete looked at --limit dead letters: more may be waiting.
	Limited bool `json:"limited"`
}

// errNotConfirmed is the error of a delete the operator did not confirm.
var errNotConfirmed = errors.New("deletion not confirmed: nothing deleted (pass --yes to delete without asking)")

func newDLQDeleteCommand() *cobra.Command {
	var f dlqFlags
	var sel selection
	var yes bool
	cmd := &cobra.Command{
		Use:   "delete",
		Short: "Remove dead letters for good, without replaying them",
		Long: `Removes the chosen dead letters from the dead-letter topic, publishing nothing; the others stay
where they are, in their order. Choose them as for dlq replay, with exactly one of --id
(repeatable; the original id of a dead letter that could not carry it matches too), --reason
(every dead letter whose reason contains the text, case-sensitive: a whole reason copied from
dlq list is an exact match) or --all.

Unless --yes is given, delete first lists the dead letters it would remove, on standard error,
and asks for confirmation on standard input; anything but "y" or "yes" (an empty or closed input
too) deletes nothing and makes the exit status 1. It then removes those dead letters and no
others: one that arrives between the question and the answer is kept, even if it matches.

What removal means: RabbitMQ acknowledges the message on the group's queue (other groups'
queues keep their copies); the SQL and SQLite queues delete its row and its leases, NATS deletes
it from the stream, Redis acknowledges it for the group and deletes the entry: other consumer
groups of the dead-letter topic no longer see it either. A deleted dead letter cannot be
replayed: its message is gone unless its producer still has it.

The exit status is 1 when an --id or the --reason matched no dead letter, or the deletion was
not confirmed.`,
		Example: `  onceflow dlq delete --broker sqlite://var/queue.db --id order-17 --id order-18
  onceflow dlq delete --broker "$ONCEFLOW_BROKER" --reason 'test message, ignore'
  onceflow dlq delete --broker 'nats://127.0.0.1:4222?group=billing' --all --yes --json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := sel.check(cmd, "delete"); err != nil {
				return err
			}
			b, err := f.open(cmd.Context())
			if err != nil {
				return err
			}
			defer b.Close()

			pick := sel.matches
			if !yes {
				// Ask about the dead letters that wait now, then delete those and no others.
				msgs, err := b.Peek(cmd.Context(), f.topic, f.limit)
				if err != nil {
					return err
				}
				var chosen []*message.Message
				for _, m := range msgs {
					if sel.matches(m) {
						chosen = append(chosen, m)
					}
				}
				if len(chosen) > 0 {
					ok, err := confirm(cmd.InOrStdin(), cmd.ErrOrStderr(), chosen, where(f.topic, b.ConsumerGroup(), b.String()))
					if err != nil {
						return err
					}
					if !ok {
						return errNotConfirmed
					}
				}
				// A dead letter's id may repeat (a message dead-lettered twice): delete as many
				// of each id as were shown.
				budget := map[string]int{}
				for _, m := range chosen {
					budget[m.UUID]++
				}
				pick = func(m *message.Message) bool {
					if budget[m.UUID] == 0 || !sel.matches(m) {
						return false
					}
					budget[m.UUID]--
					return true
				}
			}

			rep := deleteReport{Broker: b.String(), Topic: f.topic, Group: b.ConsumerGroup(),
				Deleted: []deleted{}, Kept: []kept{}}
			res, delErr := b.Delete(cmd.Context(), f.topic, f.limit, pick)
			for _, m := range res.Deleted {
				d := describe(m, false)
				rep.Deleted = append(rep.Deleted, deleted{ID: d.ID, Topic: d.Topic, Handler: d.Handler, Reason: d.Reason})
			}
			for _, m := range res.Kept {
				d := describe(m, false)
				rep.Kept = append(rep.Kept, kept{ID: d.ID, Topic: d.Topic, Handler: d.Handler, Reason: d.Reason})
			}
			rep.NotFound = sel.notFound()
			rep.Limited = len(res.Deleted)+len(res.Kept) >= f.limit

			if f.asJSON {
				if err := writeJSON(cmd.OutOrStdout(), rep); err != nil {
					return errors.Join(delErr, err)
				}
			} else {
				printDelete(cmd.OutOrStdout(), rep)
			}
			return errors.Join(delErr, sel.missed(f.topic, b.ConsumerGroup()))
		},
	}
	f.register(cmd, defaultReplayLimit, "look at most at this many dead letters, oldest first")
	sel.register(cmd, "delete")
	cmd.Flags().BoolVarP(&yes, "yes", "y", false, "delete without asking for confirmation")
	return cmd
}

// confirm shows the dead letters about to be deleted on w and reads the answer from r: true
// for "y" or "yes".
func confirm(r io.Reader, w io.Writer, chosen []*message.Message, loc string) (bool, error) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	for _, m := range chosen {
		d := describe(m, false)
		fmt.Fprintf(tw, "  %s\t%s\thandler %s: %s\n", cell(d.ID, 0), cell(d.Topic, 0), cell(d.Handler, 0), cell(d.Reason, tableReasonWidth))
	}
	if err := tw.Flush(); err != nil {
		return false, err
	}
	fmt.Fprintf(w, "Delete %s %s for good? [y/N] ", plural(len(chosen), "dead letter"), loc)
	answer, err := bufio.NewReader(r).ReadString('\n')
	if err != nil && !errors.Is(err, io.EOF) {
		return false, fmt.Errorf("read the confirmation: %w", err)
	}
	if errors.Is(err, io.EOF) && answer == "" {
		fmt.Fprintln(w)
	}
	switch strings.ToLower(strings.TrimSpace(answer)) {
	case "y", "yes":
		return true, nil
	}
	return false, nil
}

// printDelete writes the readable form of a delete report.
func printDelete(w io.Writer, rep deleteReport) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	for _, d := range rep.Deleted {
		fmt.Fprintf(tw, "deleted\t%s\t%s\thandler %s: %s\n", cell(d.ID, 0), cell(d.Topic, 0), cell(d.Handler, 0), cell(d.Reason, tableReasonWidth))
	}
	tw.Flush()
	more := ""
	if rep.Limited {
		more = " (the first --limit; more may be waiting)"
	}
	fmt.Fprintf(w, "deleted %s, kept %d %s%s\n", plural(len(rep.Deleted), "dead letter"), len(rep.Kept),
		where(rep.Topic, rep.Group, rep.Broker), more)
	for _, id := range rep.NotFound {
		fmt.Fprintf(w, "not found: %s\n", printable(id))
	}
}
