package resolver

import (
	"runtime"
	"time"

	"golang.org/x/sys/unix"
)

// readerPrio is one UDP reader thread's priority under Config.ReaderRealtime:
// real-time while the reader is within its share (rtShare), its nice value for
// the rest of a window it overran.
type readerPrio struct {
	s     *Server
	share rtShare
	rt    bool // the thread runs at real-time priority
}

// prioritizeReader locks the calling reader to its thread and raises the
// thread's priority: Config.ReaderRealtime where it is asked for and allowed,
// else Config.ReaderNice. The lock is never undone: the thread ends with the
// reader and never runs anything else (the main thread, which the runtime
// never ends, stays parked). Threads it starts (the runtime starts them from a
// thread of its own for a locked one) keep nothing of it: the priority is set
// with SCHED_RESET_ON_FORK. Without the privilege the reader is left as it
// was. It returns the priority the reader keeps to its share, nil when it
// does not run at real-time priority.
func (s *Server) prioritizeReader() *readerPrio {
	runtime.LockOSThread()
	if s.readerRealtime != 0 {
		err := setRealtime(s.readerRealtime)
		if err == nil {
			return &readerPrio{s: s, share: newRTShare(s.readerRTShare, readerRealtimeWindow), rt: true}
		}
		s.rtFailed.Do(func() {
			s.log.Warn("UDP readers run at normal priority: real-time priority refused", "priority", s.readerRealtime, "err", err)
		})
	}
	if s.readerNice == 0 {
		runtime.UnlockOSThread()
		return nil
	}
	if err := setNice(s.readerNice); err != nil {
		runtime.UnlockOSThread()
		s.niceFailed.Do(func() {
			s.log.Warn("UDP readers keep the process's priority", "nice", s.readerNice, "err", err)
		})
	}
	return nil
}

// begin is called when a batch of work starts at now: a reader that overran
// its share in an earlier window is back at real-time priority.
func (p *readerPrio) begin(now time.Time) {
	if p != nil && p.share.begin(now) != p.rt {
		p.set(!p.rt)
	}
}

// end is called when the batch begun at start is done: a reader over its
// share runs at its nice value for the rest of the window.
func (p *readerPrio) end(start time.Time) {
	if p != nil && p.share.end(start, time.Now()) != p.rt {
		p.set(!p.rt)
	}
}

func (p *readerPrio) set(rt bool) {
	var err error
	if rt {
		err = setRealtime(p.s.readerRealtime)
	} else {
		p.s.m.readerOverruns.Inc()
		err = setNice(p.s.readerNice)
	}
	if err != nil {
		p.s.log.Debug("UDP reader priority", "realtime", rt, "err", err)
	}
	p.rt = rt // failed or not: the next change is tried at the next window
}

// setRealtime puts the calling thread at real-time priority prio (SCHED_FIFO).
func setRealtime(prio int) error {
	return unix.SchedSetAttr(0, &unix.SchedAttr{Size: unix.SizeofSchedAttr, Policy: unix.SCHED_FIFO,
		Priority: uint32(prio), Flags: unix.SCHED_FLAG_RESET_ON_FORK}, 0)
}

// setNice puts the calling thread at normal priority with nice value nice.
func setNice(nice int) error {
	return unix.SchedSetAttr(0, &unix.SchedAttr{Size: unix.SizeofSchedAttr, Policy: unix.SCHED_NORMAL,
		Nice: int32(nice), Flags: unix.SCHED_FLAG_RESET_ON_FORK}, 0)
}
