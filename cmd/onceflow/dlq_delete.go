package main

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/onceflow/onceflow/deadletter"
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
	// Failed lists the chosen dead letters that could not be removed, each with why.
	Failed []failed `json:"failed"`
	Kept   []kept   `json:"kept"`
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
(repeatable; the original id of a dead letter that could not carry it matches too), a filter
(--reason: every dead letter whose reason contains the text, case-sensitive, so that a whole
reason copied from dlq list is an exact match; --handler, --from-topic, --since, --until) or
--all.

Unless --yes is given, delete first lists the dead letters it would remove, on standard error,
and asks for confirmation on standard input; anything but "y" or "yes" (an empty or closed input
too) deletes nothing and makes the exit status 1. It then removes those dead letters and no
others: one that arrives between the question and the answer is kept, even if it matches. A
dead letter whose removal fails stays, and delete goes on with the next one; the report names
each failure, with why.

What removal means: RabbitMQ acknowledges the message on the group's queue (other groups'
queues keep their copies); the SQL and SQLite queues delete its row and its leases, NATS deletes
it from the stream, Redis acknowledges it for the group and deletes the entry: other consumer
groups of the dead-letter topic no longer see it either. A deleted dead letter cannot be
replayed: its message is gone unless its producer still has it.

The exit status is 1 when a chosen dead letter could not be removed, an --id or the filter
matched no dead letter, or the deletion was not confirmed.`,
		Example: `  onceflow dlq delete --broker sqlite://var/queue.db --id order-17 --id order-18
  onceflow dlq delete --broker "$ONCEFLOW_BROKER" --reason 'test message, ignore'
  onceflow dlq delete --broker 'nats://127.0.0.1:4222?group=billing' --all --yes --json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			s, err := sel.resolve(cmd, "delete")
			if err != nil {
				return err
			}
			q, closeBroker, err := f.open(cmd.Context(), f.limit)
			if err != nil {
				return err
			}
			defer closeBroker()

			var res deadletter.Report
			var delErr error
			if yes {
				res, delErr = q.Delete(cmd.Context(), s)
			} else {
				res, delErr = confirmAndDelete(cmd, q, s)
				if errors.Is(delErr, errNotConfirmed) {
					return delErr
				}
			}
			rep := deleteReport{Broker: q.Broker(), Topic: q.Topic(), Group: q.Group(),
				Deleted: []deleted{}, Failed: failures(res.Failed), Kept: keptOf(res.Kept), NotFound: res.NotFound, Limited: res.Truncated}
			for _, r := range res.Done {
				l := r.Letter
				rep.Deleted = append(rep.Deleted, deleted{ID: l.ID, Topic: l.Topic, Handler: l.Handler, Reason: l.Reason})
			}
			if f.asJSON {
				if err := writeJSON(cmd.OutOrStdout(), rep); err != nil {
					return errors.Join(delErr, err)
				}
			} else {
				printDelete(cmd.OutOrStdout(), rep)
			}
			return errors.Join(notFound(delErr, q), missed(s, res, q))
		},
	}
	f.register(cmd, defaultReplayLimit, "look at most at this many dead letters, oldest first")
	sel.register(cmd, "delete")
	cmd.Flags().BoolVarP(&yes, "yes", "y", false, "delete without asking for confirmation")
	return cmd
}

// confirmAndDelete asks about the dead letters s chooses now, then deletes those and no others.
func confirmAndDelete(cmd *cobra.Command, q *deadletter.Queue, s deadletter.Selection) (deadletter.Report, error) {
	ctx := cmd.Context()
	chosen, missing, err := q.Choose(ctx, s)
	if err != nil {
		return deadletter.Report{}, err
	}
	if len(chosen) == 0 {
		// Nothing to ask about, nor to delete: the report says what waits.
		page, err := q.List(ctx, deadletter.Query{Limit: q.ScanLimit(), Count: true})
		return deadletter.Report{Kept: page.Letters, NotFound: missing, Truncated: page.Truncated}, err
	}
	ok, err := confirm(cmd.InOrStdin(), cmd.ErrOrStderr(), chosen, where(q.Topic(), q.Group(), q.Broker()))
	if err != nil {
		return deadletter.Report{}, err
	}
	if !ok {
		return deadletter.Report{}, errNotConfirmed
	}
	exact := deadletter.ExactSelection(chosen)
	exact.Filter = s.Filter
	res, err := q.Delete(ctx, exact)
	res.NotFound = missing
	return res, err
}

// confirm shows the dead letters about to be deleted on w and reads the answer from r: true
// for "y" or "yes".
func confirm(r io.Reader, w io.Writer, chosen []deadletter.Letter, loc string) (bool, error) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	for _, l := range chosen {
		fmt.Fprintf(tw, "  %s\t%s\thandler %s: %s\n", cell(l.ID, 0), cell(l.Topic, 0), cell(l.Handler, 0), cell(l.Reason, tableReasonWidth))
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
	fmt.Fprintf(w, "deleted %s, %skept %d %s%s\n", plural(len(rep.Deleted), "dead letter"), failedCount(len(rep.Failed)), len(rep.Kept),
		where(rep.Topic, rep.Group, rep.Broker), more)
	for _, f := range rep.Failed {
		fmt.Fprintf(w, "not deleted: %s: %s\n", printable(f.ID), printable(f.Error))
	}
	for _, id := range rep.NotFound {
		fmt.Fprintf(w, "not found: %s\n", printable(id))
	}
}
