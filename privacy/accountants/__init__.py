"""Privacy accountants: pure analysis functions plus thin stateful classes.

Style follows Opacus (pure ``analysis`` functions) and dp_accounting (``supports`` / ``compose``: an event
is checked *before* it is applied, and a rejected event leaves the accountant unchanged).

=========== ============================================================ ======================
name        what it accounts                                             source
=========== ============================================================ ======================
gdp-exact   un-subsampled Gaussians (heterogeneous S, σ): exact μ-GDP     Dong, Roth & Su 2019;
            ``μ = sqrt(Σ count·S²/σ²)``, ``δ(ε) = Φ(-ε/μ+μ/2) -          Balle & Wang 2018
            e^ε Φ(-ε/μ-μ/2)``                                             Thm. 8
pld         dp_accounting privacy-loss distributions (sampled Gaussian    dp_accounting
            under add/remove or replace-one, Gaussian, Laplace);
            pessimistic discretisation
rdp         dp_accounting RDP with the improved RDP→DP conversion         Balle et al. 2020;
            (add/remove sampled Gaussian, Gaussian, Laplace, zCDP;        Papernot & Steinke
            private selection, RepeatAndSelectEvent)                     2022
rdp-filter  the same RDP curves under a Rényi filter: valid when event    Feldman & Zrnic 2021;
            parameters are chosen adaptively (see RDPFilterAccountant)    Lécuyer 2021
zcdp        ρ-zCDP: shuffled epochs, Gaussians (ρ = S²/2σ²), pure ε       Yu et al. Prop. 1-2,
            (ρ = ε²/2); ``ε = ρ + 2 sqrt(ρ ln 1/δ)``                      Thm. 1-2; Bun & Steinke
basic       pure ε (Laplace, PureDP): ε = Σ ε_i, δ = 0                     Dwork et al.
split:a+b   events no single tight accountant covers (PLD-accounted      Dwork & Roth 2014
            releases beside a secure sum's discrete Gaussians): each      Thm. 3.16
            family by its own accountant at δ/G, added up; the smaller
            of that and rdp over all (SplitDeltaAccountant)
=========== ============================================================ ======================

Neighbouring relations: an accountant accounts one relation (the first event's); composing an event
under another raises PrivacyError. Poisson-sampled Gaussians under replace-one are accounted exactly by
``pld`` (dp_accounting's ``NeighboringRelation.REPLACE_ONE``); dp_accounting's RDP accountant refuses them,
ours (``rdp``, not the filter) adds a valid but looser curve from the weak triangle inequality
(:func:`replace_one_sampled_gaussian_rdp`), so that a lifetime ledger mixing them with events PLD cannot
account (the distributed discrete Gaussian of a secure sum) still has an accountant.

Adaptively chosen events (``event.adaptive``: parameters picked from earlier outputs, e.g. the
validation-driven DP-SGD schedule) are composed only by accountants that remain valid under *fully
adaptive* composition when the budget guard stops before the budget would be exceeded (a privacy filter,
Rogers et al. 2016): ``gdp-exact`` (Gaussian-DP filter, Smith & Thakurta 2022), ``zcdp`` (ρ adds; a
Rényi filter at every order, Feldman & Zrnic 2021), ``basic`` (pure-ε filter, Rogers et al. 2016) and
``rdp-filter``. ``pld`` and ``rdp`` refuse them: the PLD of a composition, and the choice of the best
RDP order after the fact, both assume parameters fixed in advance.

One module per accountant, as dp_accounting's ``rdp/`` and ``pld/``: ``base`` (the :class:`Accountant` class,
the names, the μ-GDP and ρ-zCDP conversions), ``gdp``, ``pld``, ``rdp`` (with ``rdp-filter`` and the RDP curves
dp_accounting lacks), ``zcdp``, ``pure_dp`` (``basic``), ``split``; ``dp_accounting_wrapper`` is what ``pld`` and
``rdp`` share, ``families`` names the single accountants, ``selection`` picks one and reads ε through it. This
package's names are its interface: import them from ``privacy.accountants``.
"""

from privacy.accountants.base import (
    ACCOUNTANTS,
    FILTER_ACCOUNTANTS,
    Accountant,
    gdp_delta,
    gdp_epsilon,
    gdp_mu,
    gdp_mu_for,
    zcdp_delta,
    zcdp_epsilon,
    zcdp_rho_for,
)
from privacy.accountants.gdp import GaussianGDPAccountant
from privacy.accountants.pld import DEFAULT_PLD_DISCRETIZATION, PLDAccountant
from privacy.accountants.pure_dp import PureDPAccountant
from privacy.accountants.rdp import (
    FILTER_RDP_ORDERS,
    RDPAccountant,
    RDPFilterAccountant,
    base_rdp_curve,
    repeat_and_select_rdp,
    replace_one_sampled_gaussian_rdp,
)
from privacy.accountants.selection import (
    accountant_for,
    epsilon_per_relation,
    epsilon_spent,
    epsilon_under,
    make_accountant,
)
from privacy.accountants.split import SPLIT_PREFIX, SplitDeltaAccountant
from privacy.accountants.zcdp import ZCDPAccountant

__all__ = [
    "ACCOUNTANTS", "FILTER_ACCOUNTANTS", "Accountant", "gdp_delta", "gdp_epsilon", "gdp_mu", "gdp_mu_for",
    "zcdp_delta", "zcdp_epsilon", "zcdp_rho_for", "GaussianGDPAccountant", "DEFAULT_PLD_DISCRETIZATION",
    "PLDAccountant", "PureDPAccountant", "FILTER_RDP_ORDERS", "RDPAccountant", "RDPFilterAccountant",
    "base_rdp_curve", "repeat_and_select_rdp", "replace_one_sampled_gaussian_rdp", "accountant_for",
    "epsilon_per_relation", "epsilon_spent", "epsilon_under", "make_accountant", "SPLIT_PREFIX",
    "SplitDeltaAccountant", "ZCDPAccountant",
]
